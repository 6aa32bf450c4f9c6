"""The CPU-checkable pieces of bench/gpu_layer.py: shapes, FLOP counts, the titan-style
reference's numerics against moe.MoELayer (float64), and the script's plumbing on CPU."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import moe
from bench import gpu_layer, gpu_roles, titan_style
from moe.kernels import kernel_config


def test_parse_shapes():
    assert titan_style.parse_shapes("mixtral") == [titan_style.PRESETS["mixtral"]]
    assert [s.T for s in titan_style.parse_shapes("all")] == [8192, 16384, 16384, 8192]
    (s,) = titan_style.parse_shapes(" 37/24/5/2/40 ")
    assert (s.T, s.d, s.E, s.k, s.F) == (37, 24, 5, 2, 40)
    for bad in ("", "mixtrall", "1/2/3", "1/2/3/4/x", "8/8/2/3/8", "0/8/8/2/8"):
        with pytest.raises(ValueError, match="--shapes"):
            titan_style.parse_shapes(bad)


def test_flops_equal_the_dense_ffn_and_the_roles():
    s = titan_style.Shape("t", 6, 8, 4, 2, 12)
    dense = titan_style.SwiGLU(s.d, s.k * s.F)
    x = torch.randn(s.T, s.d, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        dense(x).sum().backward()
    assert counter.get_total_flops() == titan_style.expert_flops(s)
    M = s.T * s.k
    roles = sum(gpu_roles.role_flops(r, M, s.d, s.F) for r in gpu_roles.ROLES)
    assert roles == titan_style.expert_flops(s)
    assert titan_style.expert_flops(s, backward=False) * 3 == roles


@pytest.mark.parametrize("T,E,k", [(37, 5, 2), (1, 3, 2), (19, 4, 1)])
def test_titan_style_matches_moe_layer(T, E, k):
    torch.manual_seed(T)
    d, F = 12, 20
    layer = moe.MoELayer(d, F, E, top_k=k, activation="swiglu", backend="torch")
    layer = layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.router.expert_bias[E - 1] = -1e9  # an expert no token picks
    titan = titan_style.TitanStyleMoE(layer.router, E, d, F, dtype=torch.float64)
    titan.load_from_moe(layer)
    x = torch.randn(T, d, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(T, d, dtype=torch.float64)
    y_ref = layer(x)
    y_ref.backward(dy)
    grads_ref = [x.grad.clone()] + [
        getattr(layer.experts, n).grad.clone() for n in ("w1", "w2", "w3")
    ]
    ref_router_grad = layer.router.weight.grad.clone()
    layer.router.weight.grad, x.grad = None, None
    y = titan(x)
    y.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for got, want in zip([x.grad, titan.w1.grad, titan.w2.grad, titan.w3.grad], grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.router.weight.grad, ref_router_grad, rtol=1e-10, atol=1e-10)
    assert titan.w1.grad[E - 1].abs().max() == 0


def test_padded_permutation_groups_are_aligned():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    gather, dest, order, offs = titan_style.padded_permutation(ids, 4, align=8)
    assert offs.tolist() == [8, 16, 24, 24]
    assert gather.shape[0] == 8 + 4 * 7
    assert gather[:3].tolist() == [0, 2, 3] and (gather[3:8] == 4).all()  # 4 = zero row
    assert sorted(dest.tolist()) == [0, 1, 2, 8, 16, 17, 18, 19]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_exits_with_one_line_without_cuda(capsys):
    assert gpu_layer.main(["--quick"]) == gpu_layer.NO_CUDA_EXIT == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA" in out[0]


def test_script_runs_on_cpu(capsys):
    """The whole candidate loop on CPU (float32, no timings): errors against the fp32 reference."""
    argv = ["--smoke-cpu", "--shapes", "21/16/5/2/24", "--only", "dense,titan-style,moe torch",
            "--no-roles", "--iters", "1", "--warmup", "0"]  # fmt: skip
    assert gpu_layer.main(argv) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 21/16")]
    by_name = {r.split("|")[2].strip(): [c.strip() for c in r.split("|")[3:-1]] for r in rows}
    assert set(by_name) == {"dense", "titan-style", "moe torch"}
    for name in ("titan-style", "moe torch"):
        errs = [float(e) for e in by_name[name][3:6]]
        assert max(errs) < 1e-5, (name, by_name[name])
    assert by_name["dense"][3:6] == ["–", "–", "–"]


def test_smoke_runs_the_triton_candidate_in_the_interpreter(capsys, monkeypatch):
    """--smoke-cpu runs moe triton in Triton's interpreter with pinned configs (it failed with
    'needs CUDA tensors' before; its GEMM roles with '0 active drivers'), and exits 1 when a
    candidate fails."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # main() sets both; restored after the test
    monkeypatch.setenv("MOE_TRITON_AUTOTUNE", "1")
    argv = ["--smoke-cpu", "--shapes", "32/16/4/2/16", "--only", "moe triton", "--no-roles"]
    assert gpu_layer.main(argv) == 0
    (row,) = {r for r in capsys.readouterr().out.splitlines() if r.startswith("| 32/16")}
    errs = [float(e) for e in [c.strip() for c in row.split("|")[3:-1]][3:6]]
    assert max(errs) < 1e-5, row
    real = gpu_layer.moe_layer
    fail = lambda s, backend, dtype: 1 / 0 if backend == "triton" else real(s, backend, dtype)  # noqa: E731
    monkeypatch.setattr(gpu_layer, "moe_layer", fail)
    assert gpu_layer.main(argv) == 1


def test_smoke_runs_the_cutlass_roles_candidate(capsys, monkeypatch):
    """ "moe triton CUTLASS roles" runs every GEMM role on torch._grouped_mm (the CPU's here) and
    matches the fp32 reference; the kernel config is the default again afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # main() sets both; restored after the test
    monkeypatch.setenv("MOE_TRITON_AUTOTUNE", "1")
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    argv = ["--smoke-cpu", "--shapes", "32/16/4/2/16", "--only", "moe triton CUTLASS roles",
            "--no-roles", "--iters", "1", "--warmup", "0"]  # fmt: skip
    assert gpu_layer.main(argv) == 0
    (row,) = {r for r in capsys.readouterr().out.splitlines() if r.startswith("| 32/16")}
    errs = [float(e) for e in [c.strip() for c in row.split("|")[3:-1]][3:6]]
    assert max(errs) < 1e-5, row
    assert calls, "no GEMM role ran on torch._grouped_mm"
    assert kernel_config().cutlass_roles is None


def test_smoke_refuses_shapes_too_big_for_the_interpreter(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_layer.main(["--smoke-cpu", "--shapes", "32/16/4/2/16,256/128/8/2/192"])
    assert e.value.code == 2
    assert "too big: 256/128/8/2/192" in capsys.readouterr().err
