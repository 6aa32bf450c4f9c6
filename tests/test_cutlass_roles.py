"""GEMM roles of the Triton expert MLP sent to CUTLASS (torch._grouped_mm; moe/kernels/gemm_roles.py,
moe/kernels/triton/cutlass_roles.py) against a per-row float64 reference: outputs and every
gradient, each role alone and all together, with gather, combine weights, the sum into tokens,
empty experts and dropped tail rows. On CPU the Triton kernels run in the interpreter and
torch._grouped_mm on the CPU (fp32 and bf16); on CUDA it is CUTLASS (bf16, sm_90+; the GPU check
runs this file). A spy on torch._grouped_mm counts the calls, so a role that silently fell back
to Triton fails the test.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytest.importorskip("triton")
if HAS_CUDA and torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("torch._grouped_mm is CUTLASS on sm_90+ only", allow_module_level=True)

import moe  # noqa: E402
from moe.kernels import KernelConfig, gemm_roles, set_kernel_config  # noqa: E402
from moe.kernels.expert_mlp import expert_mlp  # noqa: E402
from moe.kernels.expert_rows import ExpertRows  # noqa: E402
from tests import reference as ref  # noqa: E402

ROLES = gemm_roles.ROLES
DTYPES = [torch.bfloat16] if HAS_CUDA else [torch.float32, torch.bfloat16, torch.float16]
TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
}
# torch._grouped_mm calls per role, gated (two weights) and not
CALLS = {"up": 2, "down": 1, "dact": 1, "dx": 2, "wgrad13": 2, "wgrad2": 1}
CALLS_PLAIN = {**CALLS, "up": 1, "dx": 1, "wgrad13": 1}


@pytest.fixture
def roles(monkeypatch):
    """roles(which): send `which` to CUTLASS from now on; returns the list that records each
    torch._grouped_mm call from then on."""
    calls, real = [], torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    def use(which):
        calls.clear()
        set_kernel_config(KernelConfig(cutlass_roles=tuple(which)))
        return calls

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    yield use
    set_kernel_config(None)


def make(counts, tail, D, F, activation, dtype, bias=False, weights=True, sum_to_tokens=True,
         gather=True, seed=0):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    E, R, T = len(counts), sum(counts) + tail, 9
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype).to(DEVICE)
    gated = activation == "swiglu"
    return dict(
        x=rnd(T if gather else R, D),
        offsets=torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE),
        w1=rnd(E, D, F, scale=D**-0.5),
        w2=rnd(E, F, D, scale=F**-0.5),
        w3=rnd(E, D, F, scale=D**-0.5) if gated else None,
        b1=rnd(E, F, scale=0.5) if bias else None,
        b2=rnd(E, D, scale=0.5) if bias else None,
        rw=(torch.rand(R, generator=g) + 0.5).to(DEVICE) if weights else None,
        ids=torch.randint(0, T, (R,), generator=g).to(DEVICE) if gather else None,
        counts=counts, R=R, activation=activation, sum_to_tokens=sum_to_tokens and gather,
    )  # fmt: skip


LEAVES = ("x", "w1", "w2", "w3", "b1", "b2", "rw")


def run(case, dy=None):
    leaves = {k: case[k].detach().clone().requires_grad_() for k in LEAVES if case[k] is not None}
    rows = ExpertRows(gather_ids_R=case["ids"], row_weights_R=leaves.get("rw"),
                      sum_to_tokens=case["sum_to_tokens"])  # fmt: skip
    out = expert_mlp(
        leaves["x"], case["offsets"], leaves["w1"], leaves["w2"], leaves.get("w3"),
        leaves.get("b1"), leaves.get("b2"), activation=case["activation"], rows=rows,
        kernel="triton",
    )  # fmt: skip
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) if dy is None else dy
    grads = torch.autograd.grad(out, list(leaves.values()), dy.to(out))
    return out.detach(), dict(zip(leaves, grads)), dy


def reference(case, dy):
    """Per-row float64 loop; autograd through it gives every gradient."""
    lv = {
        k: case[k].detach().double().cpu().requires_grad_() for k in LEAVES if case[k] is not None
    }
    ends, D = case["offsets"].tolist(), case["w2"].shape[2]
    ids = case["ids"].tolist() if case["ids"] is not None else None
    rows = []
    for r in range(case["R"]):
        e = next((i for i, end in enumerate(ends) if r < end), None)
        if e is None:  # a dropped pair at the tail
            rows.append(lv["x"].new_zeros(D))
            continue
        src = lv["x"][ids[r] if ids is not None else r]
        y = ref.expert_ffn(src, e, lv["w1"], lv["w2"], lv.get("w3"), lv.get("b1"), lv.get("b2"),
                           case["activation"])  # fmt: skip
        rows.append(y * lv["rw"][r] if "rw" in lv else y)
    out = torch.stack(rows)
    if case["sum_to_tokens"]:
        out = torch.zeros(lv["x"].shape[0], D, dtype=torch.float64).index_add(
            0, case["ids"].cpu(), out
        )
    grads = torch.autograd.grad(out, list(lv.values()), dy.double(), allow_unused=True)
    return out.detach(), {
        k: g if g is not None else torch.zeros_like(lv[k]) for k, g in zip(lv, grads)
    }


def check(case, dtype):
    out, grads, dy = run(case)
    want, want_grads = reference(case, dy)
    torch.testing.assert_close(out.double().cpu(), want, **TOL[dtype])
    for k, g in grads.items():
        assert g.dtype == case[k].dtype, k
        torch.testing.assert_close(g.double().cpu(), want_grads[k], **TOL[dtype], msg=lambda m, k=k: f"d{k}: {m}")  # noqa: E501  # fmt: skip
    live = case["offsets"][-1].item()
    if not case["sum_to_tokens"]:
        assert torch.all(out[live:] == 0), "dropped tail rows must be exactly zero"
        if case["ids"] is None:
            assert torch.all(grads["x"][live:] == 0), "dx of dropped rows must be exactly zero"
    if "rw" in grads:
        assert torch.all(grads["rw"][live:] == 0), "d row weights of dropped rows"
    for k in ("w1", "w2", "w3"):
        empty = torch.tensor(case["counts"]) == 0
        if k in grads and empty.any():
            assert torch.all(grads[k][empty.to(DEVICE)] == 0), f"d{k} of an empty expert"
    return out, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which", [*([r] for r in ROLES), list(ROLES)], ids="+".join)
def test_each_role_on_cutlass_matches_reference(roles, which, dtype):
    """R = 24 rows (16-byte aligned for the weight-gradient form; the groups start at rows 5
    and 14, not aligned), D and F multiples of 8."""
    calls = roles(tuple(which))
    check(make([5, 0, 9, 2], 8, 16, 24, "swiglu", dtype), dtype)
    assert len(calls) == sum(CALLS[r] for r in which), f"{which}: {len(calls)} calls"


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_plain_activation_rows_returned(roles, activation):
    """Rows returned as they are (no gather, no weights): the tail rows and their dx are zero."""
    calls = roles(ROLES)
    case = make([3, 6, 0, 3], 4, 16, 24, activation, DTYPES[0], weights=False, gather=False)
    check(case, DTYPES[0])
    assert len(calls) == sum(CALLS_PLAIN.values())


@pytest.mark.parametrize("weights", [False, True], ids=["no-weights", "combine-weights"])
def test_biases_keep_their_roles_on_triton(roles, weights):
    """Fused bias epilogues stay on Triton: up (b1), down (b2), wgrad13 (db1), wgrad2 (db2 fused,
    without combine weights); dact (with b2's share of the combine weights' gradient) and dx
    still run on CUTLASS, and with combine weights dW2 too (db2 is then a separate reduction)."""
    calls = roles(ROLES)
    dtype = DTYPES[0]
    check(make([5, 0, 9, 2], 8, 16, 24, "swiglu", dtype, bias=True, weights=weights), dtype)
    assert len(calls) == CALLS["dact"] + CALLS["dx"] + (CALLS["wgrad2"] if weights else 0)


def test_unfit_operands_fall_back_to_triton(roles):
    """Widths not 16-byte aligned (D=5, F=7) run no CUTLASS call; 19 rows keep only the weight
    gradients on Triton; the results are right either way."""
    calls = roles(ROLES)
    check(make([3, 0, 9], 1, 5, 7, "swiglu", DTYPES[0], seed=2), DTYPES[0])
    assert calls == []
    check(make([5, 0, 9, 2], 3, 16, 24, "swiglu", DTYPES[0], seed=3), DTYPES[0])
    assert len(calls) == sum(CALLS.values()) - CALLS["wgrad13"] - CALLS["wgrad2"]


def test_deterministic_and_equal_to_triton(roles):
    case = make(
        [6, 0, 8, 2], 4, 16, 24, "swiglu", torch.float32 if not HAS_CUDA else torch.bfloat16
    )
    roles(ROLES)
    a, b = run(case), run(case)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    roles(())
    t = run(case, a[2])
    tol = TOL[case["x"].dtype]
    torch.testing.assert_close(a[0], t[0], **tol)
    for k in t[1]:
        torch.testing.assert_close(a[1][k], t[1][k], **tol, msg=lambda m, k=k: f"d{k}: {m}")


def test_layer_with_every_role_on_cutlass_matches_reference(roles):
    """The whole MoELayer on the Triton backend, every role on CUTLASS (T*k = 32 rows)."""
    from tests.test_layer import check_against_reference

    calls = roles(ROLES)
    torch.manual_seed(0)
    dtype = DTYPES[0]
    layer = moe.MoELayer(16, 24, 4, top_k=2, backend="triton", activation="swiglu")
    layer = layer.to(DEVICE, dtype)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)  # as test_cuda
    check_against_reference(layer, torch.randn(16, 16, device=DEVICE, dtype=dtype), **tol)
    assert len(calls) == sum(CALLS.values())


def test_triton_cutlass_kernel_is_triton_with_every_role_on_cutlass(roles):
    """backend="triton_cutlass" (a registered kernel, its roles a setting of it) computes what
    backend="triton" computes with KernelConfig(cutlass_roles=ROLES), bit for bit, and calls
    CUTLASS for every role while KernelConfig itself says none."""
    torch.manual_seed(0)
    x = torch.randn(16, 16, device=DEVICE, dtype=DTYPES[0])
    results = []
    for backend, which in (("triton", ROLES), ("triton_cutlass", ())):
        calls = roles(which)
        torch.manual_seed(1)
        layer = moe.MoELayer(16, 24, 4, top_k=2, backend=backend, activation="swiglu")
        layer = layer.to(DEVICE, DTYPES[0])
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.square().sum().backward()
        results.append([y, xi.grad, *(p.grad for p in layer.parameters())])
        assert len(calls) == sum(CALLS.values()), backend
    assert layer.experts.kernel.cutlass_roles == ROLES
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_table_and_config_pick_the_roles(monkeypatch):
    default = KernelConfig()
    assert default.roles_on_cutlass(4096, 14336) == ()  # today's table: every role on Triton
    monkeypatch.setitem(gemm_roles.TABLE, ("dx", "wide-ffn"), "cutlass")
    assert default.roles_on_cutlass(4096, 14336) == ("dx",)
    assert default.roles_on_cutlass(2048, 768) == ()
    forced = KernelConfig(cutlass_roles=("up", "wgrad2"))
    assert (
        forced.roles_on_cutlass(4096, 14336)
        == forced.roles_on_cutlass(2048, 768)
        == (
            "up",
            "wgrad2",
        )
    )
    assert KernelConfig(cutlass_roles=()).roles_on_cutlass(4096, 14336) == ()
    for bad in (("dw",), ["up"], "up"):
        with pytest.raises(ValueError, match="cutlass_roles must be None or a tuple of GEMM roles"):
            KernelConfig(cutlass_roles=bad)


def test_opcheck_with_cutlass_roles():
    import moe.kernels.triton.expert_mlp  # noqa: F401  (registers the op)

    case = make([4, 0, 4], 4, 16, 16, "gelu", torch.float32 if not HAS_CUDA else torch.bfloat16)
    x, w1 = case["x"].requires_grad_(), case["w1"].requires_grad_()
    args = (x, case["offsets"], w1, case["w2"], None, None, None, case["ids"], case["rw"], None,
            "gelu", True, True, ",".join(ROLES))  # fmt: skip
    torch.library.opcheck(torch.ops.moe.triton_expert_mlp.default, args)


def test_recompute_and_gradient_accumulation_match_the_triton_roles(roles):
    """MoELayer(recompute=True) over two accumulated micro-batches: every role on CUTLASS gives
    the gradients of every role on Triton (itself tested against float64 above)."""
    dtype = DTYPES[0]
    torch.manual_seed(3)
    xs = [torch.randn(16, 16, device=DEVICE, dtype=dtype) for _ in range(2)]
    grads = {}
    for which in (ROLES, ()):
        calls = roles(which)
        torch.manual_seed(0)
        layer = moe.MoELayer(16, 24, 4, top_k=2, backend="triton", activation="swiglu",
                             recompute=True).to(DEVICE, dtype)  # fmt: skip
        for x in xs:
            layer(x.clone().requires_grad_()).square().sum().backward()
        grads[which] = {n: p.grad for n, p in layer.named_parameters()}
        assert bool(calls) == bool(which), len(calls)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    for n, g in grads[()].items():
        torch.testing.assert_close(grads[ROLES][n], g, **tol, msg=lambda m, n=n: f"{n}: {m}")


def _ep_body(rank, world, cases):
    """Each case trained on this rank's shard with every role on CUTLASS: the gathered
    parameters and last step's gradients, this rank's losses and how many torch._grouped_mm
    calls ran here."""
    from moe.parallel import init_mesh, parallelize
    from tests.test_parallel import _shard, build_model, global_batches, train

    calls, real = [], torch._grouped_mm
    torch._grouped_mm = lambda *a, **k: calls.append(1) or real(*a, **k)
    set_kernel_config(KernelConfig(cutlass_roles=ROLES))
    out = {}
    for name, sizes, parallel in cases:
        calls.clear()
        model = parallelize(build_model(backend="triton"), init_mesh(dp=1, ep=world), **parallel)
        losses = train(model, global_batches(sizes), _shard(sizes, rank), world, sgd=True)
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out[name] = (params, grads, losses, len(calls))
    return out


EP_CASES = [
    ("ep2_ddp", [8, 4], {"data_parallel": "ddp"}),
    ("ep2_fsdp", [4, 8], {"data_parallel": "fsdp"}),
    ("ep2_overlapped", [8, 8], {"overlap": 2}),
]


@pytest.mark.skipif(HAS_CUDA, reason="gloo ranks on CPU (the kernels in the interpreter)")
def test_expert_parallel_training_with_every_role_on_cutlass_equals_one_process():
    """EP over 2 ranks with ddp, fsdp and the overlapped dispatcher, every role on CUTLASS:
    the losses of three SGD steps (summed over ranks / world: the global mean), the last
    step's gradients and the parameters after it equal one process's (torch backend) on the
    global batch."""
    from tests.distributed import run_ranks
    from tests.test_parallel import build_model, global_batches, train

    results = run_ranks(_ep_body, 2, EP_CASES, timeout=300)
    for name, sizes, _ in EP_CASES:
        reference = build_model()
        ref_losses = train(reference, global_batches(sizes), slice(None), 1, sgd=True)
        losses = [sum(r[name][2][i] for r in results) / 2 for i in range(len(ref_losses))]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, msg=f"{name} losses")
        for rank in range(2):
            params, grads, _, calls = results[rank][name]
            assert calls > 0, f"{name} rank {rank}: no role ran on CUTLASS"
            for n, p in reference.named_parameters():
                for got, want, what in (
                    (params[n], p.detach(), "param"),
                    (grads[n], p.grad, "grad"),
                ):
                    where = f"{name} rank {rank} {what} {n}"
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6,
                                               msg=lambda m, where=where: f"{where}: {m}")  # fmt: skip
