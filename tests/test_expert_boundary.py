"""The expert boundary (issue 39): a kernel and a dispatcher defined outside moe/ plug in by
registration alone. A per-expert loop kernel registered here runs MoELayer single-process and
under parallelize (EP over 2 gloo ranks, plain and overlapped) and matches the torch kernel's
outputs and gradients; the test dispatcher "allgather" (tests/allgather_dispatcher.py) is
chosen with parallelize(dispatcher=); ExpertWeights slices; a kernel that cannot take an input
says so, naming the layer, the kernel and the reason, before any work."""

import pathlib
import re
from dataclasses import dataclass

import pytest
import torch

import moe
from moe.kernels import ExpertKernel, ExpertWeights, register_kernel
from moe.kernels.activations import GATED, apply_activation
from moe.kernels.torch_kernel import TORCH
from moe.parallel import init_mesh, parallelize
from tests import allgather_dispatcher  # noqa: F401  (registers the "allgather" dispatcher)
from tests.distributed import run_ranks

D, F, E = 8, 12, 4


@dataclass(frozen=True)
class LoopKernel(ExpertKernel):
    """The reference: each expert's MLP on its rows in a Python loop (host reads; a test's
    kernel). Returns rows (no fused combine): gathered, scaled by the combine weights, tail 0."""

    fuses_combine: bool = False
    calls: list = None  # appended to per call (a mutable counter on a frozen kernel)

    def mlp(self, x_ND, offsets_L, weights, *, activation, rows):
        self.calls.append(weights.num_experts)
        x_RD = x_ND if rows.gather_ids_R is None else x_ND[rows.gather_ids_R]
        ends = offsets_L.tolist()
        w = weights
        pieces = []
        for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends)):
            h = x_RD[a:b] @ w.w1_LDF[e] + (0 if w.b1_LF is None else w.b1_LF[e])
            gate = x_RD[a:b] @ w.w3_LDF[e] if activation in GATED else None
            y = apply_activation(h, activation, gate) @ w.w2_LFD[e]
            pieces.append(y + (0 if w.b2_LD is None else w.b2_LD[e]))
        tail = x_RD.new_zeros(x_RD.shape[0] - (ends[-1] if ends else 0), w.w2_LFD.shape[2])
        out_RD = torch.cat([*pieces, tail])
        if rows.row_weights_R is not None:
            out_RD = out_RD * rows.row_weights_R.to(out_RD.dtype).unsqueeze(1)
        return out_RD


LOOP = register_kernel(LoopKernel("test_loop", calls=[]))
FP32_ONLY = register_kernel(LoopKernel("test_fp32_only", dtypes=(torch.float32,), calls=[]))


def _grads(model, x, scale=1.0):
    """Output and the gradients of (y^2).sum() * scale with respect to x and every parameter
    (DTensor gradients gathered whole)."""
    y = model(x)
    (y.square().sum() * scale).backward()
    out = {"y": y.detach(), "dx": x.grad}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _layer(backend, **options):
    torch.manual_seed(0)
    layer = moe.MoELayer(D, F, E, top_k=2, backend=backend, **options)
    return layer.double()


SINGLE = {
    "gelu": {},
    "swiglu_bias_drops": {"activation": "swiglu", "bias": True, "capacity_factor": 0.75},
    "recompute_shared": {"recompute": True, "num_shared_experts": 1},
    "expert_choice": {"router": "expert_choice", "capacity_factor": 1.0},
}


@pytest.mark.parametrize("options", SINGLE.values(), ids=SINGLE.keys())
def test_registered_kernel_matches_the_torch_kernel(options):
    got, want = {}, {}
    for kernel, out in (("test_loop", got), ("torch", want)):
        layer = _layer(kernel, **options)
        x = torch.randn(7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        out.update(_grads(layer.train(), x.requires_grad_()))
        assert layer.experts.kernel is (LOOP if kernel == "test_loop" else TORCH)
    assert LOOP.calls, "the registered kernel was not called"
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_kernel_that_refuses_names_layer_kernel_and_reason_before_any_work():
    layer = moe.MoELayer(D, F, E, top_k=2, backend="test_fp32_only", name="blocks.3.moe")
    layer.double()
    with pytest.raises(ValueError, match=r"blocks\.3\.moe: kernel 'test_fp32_only' .*float64"):
        layer(torch.randn(5, D, dtype=torch.float64))
    assert layer.stats == {} and not FP32_ONLY.calls  # refused before routing or compute
    with pytest.raises(ValueError, match="backend='nope' is not one of"):
        moe.MoELayer(D, F, E, backend="nope")


def test_expert_weights_slice_and_flat_form():
    g = torch.Generator().manual_seed(0)
    w = ExpertWeights(
        torch.randn(4, 3, 5, generator=g),
        torch.randn(4, 5, 3, generator=g),
        b2_LD=torch.randn(4, 3, generator=g),
        scales={"w1": torch.rand(4, 5, generator=g)},
        format="test_scaled",
    )
    part = w.slice(1, 2)
    assert part.num_experts == 2 and part.format == "test_scaled" and part.w3_LDF is None
    assert torch.equal(part.w1_LDF, w.w1_LDF[1:3]) and torch.equal(part.b2_LD, w.b2_LD[1:3])
    assert torch.equal(part.scales["w1"], w.scales["w1"][1:3])
    again = w.with_tensors(w.tensors())
    assert all(a is b for a, b in zip(again.tensors(), w.tensors()))
    refused = TORCH.refuse(torch.zeros(1, 3), w)
    assert "test_scaled" in refused  # the torch kernel reads only "dense" weights


PARALLEL = {  # name -> (backend, parallelize keywords)
    "loop_plain": ("test_loop", {}),
    "loop_overlap": ("test_loop", {"overlap": 2}),
    "loop_fsdp": ("test_loop", {"data_parallel": "fsdp"}),
    "allgather": ("torch", {"dispatcher": "allgather"}),
}


def _ranks_body(rank, world):
    import torch.distributed as dist

    errors = []
    for bad in ({"dispatcher": "nope"}, {"dispatcher": "allgather", "overlap": 2}):
        try:
            parallelize(_layer("torch"), init_mesh(dp=1, ep=world), **bad)
        except ValueError as e:
            errors.append(str(e))
    sizes = [5, 6]
    x_all = torch.randn(
        sum(sizes), D, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    want = _grads(_layer("torch"), x_all.clone().requires_grad_(), 1.0 / world)
    want["y"], want["dx"] = want["y"][mine], want["dx"][mine] * world
    diffs = {}
    for name, (backend, keywords) in PARALLEL.items():
        model = parallelize(_layer(backend), init_mesh(dp=1, ep=world), **keywords)
        assert (
            type(model.dispatcher).__name__
            == {
                "loop_plain": "ExpertParallelDispatcher",
                "loop_overlap": "OverlappedDispatcher",
                "loop_fsdp": "ExpertParallelDispatcher",
                "allgather": "AllGatherDispatcher",
            }[name]
        )
        got = _grads(model, x_all[mine].clone().requires_grad_())
        diffs[name] = {k: float((got[k] - want[k]).abs().max()) for k in want}
    dist.barrier()
    return errors, diffs, len(LOOP.calls)


def test_registered_kernel_and_dispatcher_under_parallelize_equal_one_process():
    for errors, diffs, loop_calls in run_ranks(_ranks_body, 2, timeout=180):
        assert "dispatcher='nope' is not one of" in errors[0]
        assert "dispatcher='allgather' takes no overlap degree" in errors[1]
        assert loop_calls >= 2  # the registered kernel ran (plain and overlapped)
        for name, by_tensor in diffs.items():
            assert len(by_tensor) >= 5, by_tensor
            assert max(by_tensor.values()) < 1e-10, (name, by_tensor)


def test_no_positional_weight_tuple_above_the_kernels():
    """The expert weights travel as one ExpertWeights from the experts module to the kernel:
    no (w1, w2, w3, ...) tuple is packed or unpacked on that path (the layer, the experts,
    the dispatchers; the custom ops' signatures inside moe/kernels/ stay positional)."""
    root = pathlib.Path(moe.__file__).parent
    files = [root / "layer.py", root / "experts.py", *(root / "dispatch").glob("*.py")]
    tuple_re = re.compile(r"\bw1\w*, w2\w*, w3")
    found = [
        f"{path.name}:{n}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if tuple_re.search(line)
    ]
    assert len(files) > 5 and not found, found
