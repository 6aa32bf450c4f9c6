"""CUDA as a device: the examples' --device parsing (on the CPU, with torch.cuda patched), the
test session's kernel-config pin, and CUDA variants of the key tests (skipped without CUDA).

Each CUDA case shares its helper with a CPU case of the same test, so the comparison logic
runs in CPU CI too; only the device changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe
from examples import device as exdevice
from examples.hf import finetune
from examples.m6 import train
from moe.kernels.triton.common import autotune_prune
from tests.distributed import free_port, run_ranks
from tests.test_layer import layer_params, reference_layer
from tests.tolerance import assert_close_in

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


# -- --device parsing (CPU, torch.cuda patched) ---------------------------------------------
def _gpus(monkeypatch, count: int, local_rank: str | None = None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)


@pytest.mark.parametrize(
    "spec, gpus, local_rank, expected",
    [
        ("auto", 0, None, "cpu"),
        ("auto", 2, None, "cuda:0"),
        ("auto", 2, "1", "cuda:1"),  # torchrun: each rank on LOCAL_RANK's GPU
        ("cpu", 2, None, "cpu"),
        ("cuda", 1, None, "cuda:0"),
        ("cuda", 4, "3", "cuda:3"),
        ("CUDA:1", 2, "0", "cuda:1"),  # an explicit index wins over LOCAL_RANK
    ],
)
def test_resolve_device(monkeypatch, spec, gpus, local_rank, expected):
    _gpus(monkeypatch, gpus, local_rank)
    assert exdevice.resolve_device(spec) == torch.device(expected)


@pytest.mark.parametrize(
    "spec, gpus, local_rank, message",
    [
        ("tpu", 1, None, "--device 'tpu' is unknown"),
        ("cuda:x", 1, None, "--device 'cuda:x' is unknown"),
        ("cuda", 0, None, "--device cuda: CUDA is not available"),
        ("cuda:0", 0, None, "--device cuda:0: CUDA is not available"),
        ("cuda:7", 1, None, "--device cuda:7: no GPU 7; this machine has 1 GPU(s)"),
        ("auto", 2, "2", "no GPU 2 (LOCAL_RANK=2); this machine has 2 GPU(s)"),
    ],
)
def test_bad_device_is_one_line(monkeypatch, spec, gpus, local_rank, message):
    _gpus(monkeypatch, gpus, local_rank)
    with pytest.raises(ValueError) as info:
        exdevice.resolve_device(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_precision_backend_and_autocast():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert exdevice.use_bf16("auto", gpu) and not exdevice.use_bf16("auto", cpu)
    assert not exdevice.use_bf16("fp32", gpu) and exdevice.use_bf16("bf16", cpu)
    assert (exdevice.backend(gpu), exdevice.backend(cpu)) == ("nccl", "gloo")
    with exdevice.autocast("bf16", cpu):
        assert torch.mm(torch.randn(2, 3), torch.randn(3, 2)).dtype == torch.bfloat16
    with exdevice.autocast("auto", cpu):
        assert torch.mm(torch.randn(2, 3), torch.randn(3, 2)).dtype == torch.float32


def test_m6_ranks_take_their_local_gpu_and_nccl(monkeypatch):
    """Under torchrun with --device auto, rank 1 of 2 binds cuda:1 and starts NCCL."""
    import argparse

    from examples.m6 import setup

    _gpus(monkeypatch, 2, "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", lambda b, **kw: calls.append(("init", b)))
    device = exdevice.resolve_device("auto")
    assert setup.init_distributed(argparse.Namespace(timeout=5.0), device) == (1, 2, True)
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "nccl")]


def test_m6_device_errors_are_one_line(monkeypatch, tmp_path, capsys):
    _gpus(monkeypatch, 1)
    for spec, message in [("cuda:7", "no GPU 7"), ("tpu", "is unknown")]:
        assert train.main(["--device", spec, "--run-dir", str(tmp_path), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --device ") and message in err and "\n" not in err, err
    _gpus(monkeypatch, 0)
    assert train.main(["--device", "cuda", "--run-dir", str(tmp_path), "--quiet"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_hf_device_errors_are_an_argparse_error(monkeypatch, capsys):
    _gpus(monkeypatch, 0)
    with pytest.raises(SystemExit) as info:
        finetune.parse_args(["--device", "cuda"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("error: --device cuda: CUDA is not available "
                                                 "on this machine (use cpu)")  # fmt: skip


# -- the test session's kernel-config pin ---------------------------------------------------
def test_autotune_is_pinned_in_tests(monkeypatch):
    """Pinned, the prune keeps one config, fitted to the dtype and epilogue (fp32 halves
    BLOCK_K; activation epilogues skip tiles that would spill), so nothing is benchmarked."""
    import os

    import triton

    from moe.kernels.triton import grouped_mm

    assert os.environ.get("MOE_TRITON_AUTOTUNE") == "0"  # tests/conftest.py
    big = triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8)
    small = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4)
    fp32 = {"a_ptr": torch.empty(1, dtype=torch.float32)}
    prune = autotune_prune(grouped_mm._prune)
    (kept,) = prune([big, small], fp32, EPILOGUE=grouped_mm.EPI_ACT)
    assert kept.kwargs == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    assert [c.kwargs for c in autotune_prune()([big, small], fp32)] == [big.kwargs]
    from moe.kernels import KernelConfig, kernel_config, set_kernel_config

    assert kernel_config().autotune is False
    set_kernel_config(KernelConfig(autotune=True))  # in code: the variable was read once
    try:
        assert len(prune([big, small], fp32, EPILOGUE=grouped_mm.EPI_PLAIN)) == 2
    finally:
        set_kernel_config(None)


@needs_cuda
def test_compiled_kernels_are_not_benchmarked_in_tests():
    from moe.kernels.triton import grouped_mm, grouped_mm_wgrad

    for dtype in (torch.float32, torch.bfloat16):
        _check_layer("cuda", dtype, "triton")
    for kernel in (grouped_mm._ragged_rows_kernel, grouped_mm_wgrad._ragged_reduce_kernel):
        assert kernel.cache, "the kernel did not run"
        assert len(getattr(kernel, "configs_timings", None) or {}) <= 1


# -- the layer against the float64 reference ------------------------------------------------
LAYER_CASES = [
    pytest.param(device, dtype, backend, marks=[needs_cuda] if device == "cuda" else [])
    for device in ("cpu", "cuda")
    for dtype in (torch.float32, torch.bfloat16)
    for backend in ("torch", "triton")
    if not (device == "cpu" and backend == "triton")  # CPU: tests/test_triton_kernels.py
]


def _check_layer(device: str, dtype: torch.dtype, backend: str) -> None:
    """Outputs and every gradient of a layer on `device` against the per-token float64 loop
    (run on the CPU with the same weights)."""
    torch.manual_seed(7)
    T, D, F, E = 37, 32, 48, 6  # T not a multiple of any block
    options = dict(top_k=2, capacity_factor=1.0, bias=True)
    layer = moe.MoELayer(D, F, E, backend=backend, **options).to(device=device, dtype=dtype)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    y = layer(x)
    g = torch.randn(T, D, dtype=torch.float64)
    (y.double() * g.to(device)).sum().backward()
    cpu = moe.MoELayer(D, F, E, **options).to(dtype)  # the same weights, on the CPU
    cpu.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
    y_ref, x_ref, params, dropped = reference_layer(cpu, x.detach().cpu())
    (y_ref * g).sum().backward()
    pairs = [("y", y, y_ref), ("dx", x.grad, x_ref.grad)]
    pairs += [(f"d{n}", p.grad, params[n].grad) for n, p in layer_params(layer).items()]
    for name, actual, expected in pairs:
        if dtype == torch.float32:
            torch.testing.assert_close(actual.double().cpu(), expected, rtol=1e-4, atol=1e-4,
                                       msg=name)  # fmt: skip
        else:  # bf16's rounding relative to the values' scale (the CPU measures ~1 eps; the
            # CUDA kernels accumulate in another order: 6 eps, still below a 10 % error's 13)
            assert_close_in(dtype, actual, expected, ulps=4.0 if device == "cpu" else 6.0,
                            msg=name)  # fmt: skip
    assert int(layer.stats["dropped"]) == dropped


@pytest.mark.parametrize("device, dtype, backend", LAYER_CASES)
def test_layer_against_float64_reference(device, dtype, backend):
    _check_layer(device, dtype, backend)


@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_layer_equals_eager_on_cuda(backend):
    torch.manual_seed(3)
    layer = moe.MoELayer(32, 64, 8, top_k=2, backend=backend).cuda().bfloat16()
    x = torch.randn(45, 32, device="cuda", dtype=torch.bfloat16)
    grads = []
    for fn in (layer, torch.compile(layer, fullgraph=False)):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.float().square().sum().backward()
        grads.append((y.detach(), xi.grad, layer.experts.w1.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


# -- one M6 step ----------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_m6_steps(device, tmp_path):
    argv = ["--steps", "2", "--global-batch", "16", "--device", device, "--log-every", "2"]
    s = train.run(
        [*argv, "--eval-every", "1000", "--quiet", "--no-plots", "--run-dir", str(tmp_path)]
    )
    assert s["device"].startswith(device) and len(s["losses"]) == 2
    assert all(torch.isfinite(torch.tensor(s["losses"])))


# -- FSDP2 on one rank ----------------------------------------------------------------------
def _fsdp_one_rank(rank, world, backend, device):
    """One FSDP2 step of parallelize(..., "fsdp") at (dp, ep) = (1, 1) on `backend` equals the
    plain model's step: loss and every gradient."""
    from moe.parallel import init_mesh, parallelize
    from tests.test_parallel import D, build_model

    if backend != dist.get_backend():
        dist.destroy_process_group()
        torch.cuda.set_device(device)
        url = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(backend, init_method=url, rank=rank, world_size=world)
    plain = build_model().to(device)
    model = parallelize(
        build_model().to(device), init_mesh(1, 1, device_type=torch.device(device).type), "fsdp"
    )
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(19, D, generator=g).to(device) for _ in range(2))
    losses = []
    for m in (plain, model):
        loss = (m(x) - y).square().mean()
        loss.backward()
        losses.append(float(loss))
    diffs = []
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        diffs.append((name, float((grad - q.grad).abs().max())))
    return losses, diffs


@pytest.mark.parametrize(
    "backend, device", [("gloo", "cpu"), pytest.param("nccl", "cuda:0", marks=needs_cuda)]
)
def test_fsdp2_one_rank(backend, device):
    (losses, diffs), = run_ranks(_fsdp_one_rank, 1, backend, device, timeout=120)  # fmt: skip
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)
    assert all(d <= 1e-6 for _, d in diffs), diffs
