"""Triton expert kernels against a naive float64 per-row reference: outputs and every gradient.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before any kernel
module is imported; the kernels re-decorate themselves if they were imported earlier in the
other mode). With CUDA the same tests run compiled; the few CUDA-only tests skip without it.
Sizes are tiny and awkward on purpose: M not a multiple of the 16-row block, empty experts,
one expert with every row, E = 1, dropped tail rows, D and F not multiples of 16.
"""

import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (no GPU on this machine)")

pytest.importorskip("triton")

from moe.kernels.activations import GATED, apply_activation  # noqa: E402
from moe.kernels.expert_mlp import expert_mlp, resolve_backend  # noqa: E402
from moe.kernels.expert_rows import ExpertRows  # noqa: E402
from moe.kernels.triton import common as triton_common  # noqa: E402
from moe.kernels.triton.combine import combine_triton  # noqa: E402
from moe.kernels.triton.gather_sum import rows_to_tokens  # noqa: E402
from moe.kernels.triton.schedule import tile_schedule  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def assert_close(got, ref, dtype, what):
    """Max error relative to the reference's scale (entries near zero make rtol meaningless)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = max(ref.abs().max().item(), 1e-6) if ref.numel() else 1.0
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype]} * {scale:.3g}"


# ----------------------------------------------------------------------------- expert MLP
def make_case(counts, tail, D, F, activation="gelu", bias=False, gather=True, dtype=torch.float32,
              T=None, seed=0):  # fmt: skip
    """Inputs of one expert_mlp call: rows sorted by expert, `tail` dropped rows at the end."""
    g = torch.Generator().manual_seed(seed)
    E, M = len(counts), sum(counts) + tail
    T = T if T is not None else max(M // 2, 1)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype).to(DEVICE)
    case = dict(
        x=rnd(T if gather else M, D),
        offsets=torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE),
        w1=rnd(E, D, F, scale=D**-0.5),
        w2=rnd(E, F, D, scale=F**-0.5),
        w3=rnd(E, D, F, scale=D**-0.5) if activation in GATED else None,
        b1=rnd(E, F, scale=0.5) if bias else None,
        b2=rnd(E, D, scale=0.5) if bias else None,
        ids=torch.randint(0, T, (M,), generator=g).to(DEVICE) if gather else None,
        activation=activation,
        dy=rnd(M, D),
    )
    return case


PARAMS = ("x", "w1", "w2", "w3", "b1", "b2")


def run_triton(case):
    leaves = {k: case[k].detach().clone().requires_grad_() for k in PARAMS if case[k] is not None}
    out = expert_mlp(
        leaves["x"], case["offsets"], leaves["w1"], leaves["w2"], leaves.get("w3"),
        leaves.get("b1"), leaves.get("b2"), activation=case["activation"],
        rows=ExpertRows(gather_ids_R=case["ids"]), kernel="triton",
    )  # fmt: skip
    out.backward(case["dy"])
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def run_reference(case):
    """Naive per-row loop in float64 (autograd through it gives the reference gradients)."""
    leaves = {
        k: case[k].detach().double().cpu().requires_grad_() for k in PARAMS if case[k] is not None
    }
    x, w1, w2 = leaves["x"], leaves["w1"], leaves["w2"]
    ends = case["offsets"].tolist()
    ids = case["ids"].tolist() if case["ids"] is not None else None
    M, D = case["dy"].shape
    rows = []
    for m in range(M):
        e = next((i for i, end in enumerate(ends) if m < end), None)
        if e is None:  # dropped pair at the tail
            rows.append(x.new_zeros(D))
            continue
        xm = x[ids[m] if ids is not None else m]
        h = xm @ w1[e] + (leaves["b1"][e] if "b1" in leaves else 0)
        gate = xm @ leaves["w3"][e] if "w3" in leaves else None
        y = apply_activation(h, case["activation"], gate) @ w2[e]
        rows.append(y + (leaves["b2"][e] if "b2" in leaves else 0))
    out = torch.stack(rows) if rows else x.new_zeros(0, D)
    if out.requires_grad:  # else every row was dropped: all gradients are zero
        out.backward(case["dy"].double().cpu())
    return out.detach(), {
        k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()
    }


def check_case(case, dtype=torch.float32):
    out, grads = run_triton(case)
    ref_out, ref_grads = run_reference(case)
    assert out.dtype == case["x"].dtype
    assert_close(out, ref_out, dtype, "out")
    for k, ref in ref_grads.items():
        assert grads[k] is not None, f"no gradient for {k}"
        assert grads[k].dtype == case[k].dtype
        assert_close(grads[k], ref, dtype, f"d{k}")
    live = case["offsets"][-1].item()
    assert torch.all(out[live:] == 0), "dropped tail rows must be exactly zero"
    counts = torch.diff(case["offsets"].cpu(), prepend=torch.zeros(1, dtype=torch.int32))
    for k in ("w1", "w2", "w3", "b1", "b2"):
        if k in grads:
            assert torch.all(grads[k][counts.to(grads[k].device) == 0] == 0), (
                f"d{k} of empty experts"
            )
    if case["ids"] is not None:  # tokens that only dropped rows point at get exactly zero dx
        used = torch.zeros(case["x"].shape[0], dtype=torch.bool, device=case["x"].device)
        used[case["ids"][:live]] = True
        assert torch.all(grads["x"][~used] == 0)
    return out, grads


MLP_CASES = {
    # id: (counts per expert, dropped tail rows, D, F, activation, bias, gather)
    "gelu-bias-gather": ([7, 0, 12], 3, 24, 40, "gelu", True, True),
    "gelu_tanh": ([5, 0, 17, 2], 2, 24, 40, "gelu_tanh", False, True),
    "relu-bias": ([5, 0, 17, 2], 2, 24, 40, "relu", True, True),
    "silu": ([5, 0, 17, 2], 2, 24, 40, "silu", False, True),
    "swiglu-bias": ([5, 0, 17, 2], 2, 24, 40, "swiglu", True, True),
    "M=1": ([0, 1], 0, 24, 40, "gelu", True, True),
    "E=1-all-rows-no-gather": ([37], 0, 24, 40, "swiglu", False, False),
    "one-expert-takes-all": ([0, 0, 33, 0], 4, 24, 40, "swiglu", True, True),
    "D=5-F=7": ([3, 9], 1, 5, 7, "swiglu", True, True),
    "all-dropped": ([0, 0], 6, 24, 40, "gelu", True, True),
    "no-rows": ([0, 0, 0], 0, 24, 40, "relu", True, True),
    "K-multiple-of-16": ([16, 0, 20], 0, 32, 48, "gelu", False, False),
}


@pytest.mark.parametrize("name", list(MLP_CASES))
def test_expert_mlp_fp32(name):
    counts, tail, D, F, activation, bias, gather = MLP_CASES[name]
    check_case(
        make_case(counts, tail, D, F, activation, bias, gather, T=7 if name == "no-rows" else None)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_expert_mlp_half(dtype, activation):
    """bf16 goes through the same kernels; under the interpreter its tiles are upcast for tl.dot."""
    check_case(make_case([9, 0, 14, 3], 2, 24, 40, activation, True, True, dtype=dtype), dtype)


def test_expert_mlp_many_experts():
    """E = 512 local experts, almost all empty (the schedule is a 1024-lane cumsum)."""
    g = torch.Generator().manual_seed(3)
    counts = [0] * 512
    for e in torch.randint(0, 512, (40,), generator=g).tolist():
        counts[e] += 1
    check_case(make_case(counts, 3, 16, 16, "swiglu", True, True, seed=3))


def test_expert_mlp_deterministic():
    case = make_case([6, 0, 19, 5], 2, 24, 40, "swiglu", True, True, dtype=torch.bfloat16, T=8)
    out1, g1 = run_triton(case)
    out2, g2 = run_triton(case)
    assert torch.equal(out1, out2)
    for k in g1:
        assert torch.equal(g1[k], g2[k]), f"d{k} differs between two identical runs"


def test_expert_mlp_matches_torch_backend_no_grad():
    case = make_case([4, 11, 0, 6], 1, 24, 40, "gelu", True, True)
    args = (case["x"], case["offsets"], case["w1"], case["w2"], None, case["b1"], case["b2"])
    with torch.no_grad():
        a = expert_mlp(
            *args, activation="gelu", rows=ExpertRows(gather_ids_R=case["ids"]), kernel="triton"
        )
        b = expert_mlp(
            *args, activation="gelu", rows=ExpertRows(gather_ids_R=case["ids"]), kernel="torch"
        )
    assert_close(a, b, torch.float32, "out vs torch backend")


# ----------------------------------------------------------------------------- combine
def make_combine(T, K, D, dropped, dtype, seed=0):
    """Pairs point at distinct rows of out_MD; dropped pairs have weight 0 and share the last row."""
    g = torch.Generator().manual_seed(seed)
    M = T * K + 1
    rows = torch.randperm(M - 1, generator=g)[: T * K].view(T, K)
    w = torch.rand(T, K, generator=g)
    drop = torch.rand(T, K, generator=g) < dropped
    rows[drop], w[drop] = M - 1, 0.0
    out = torch.randn(M, D, generator=g).to(dtype)
    out[M - 1] = 0
    dy = torch.randn(T, D, generator=g).to(dtype)
    return out.to(DEVICE), rows.to(DEVICE), w.to(DEVICE), dy.to(DEVICE)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_combine(dtype):
    out, rows, w, dy = make_combine(T=13, K=3, D=24, dropped=0.3, dtype=dtype)
    o = out.clone().requires_grad_()
    wt = w.clone().requires_grad_()
    y = combine_triton(o, rows, wt)
    y.backward(dy)
    # float64 per-token loop
    o64, w64 = out.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    r = rows.cpu().tolist()
    ref = torch.stack(
        [sum(w64[t, j] * o64[r[t][j]] for j in range(rows.shape[1])) for t in range(rows.shape[0])]
    )
    ref.backward(dy.double().cpu())
    assert y.dtype == dtype and wt.grad.dtype == torch.float32
    assert_close(y, ref, dtype, "combine out")
    assert_close(o.grad, o64.grad, dtype, "combine d_out")
    assert_close(wt.grad, w64.grad, dtype, "combine d_weights")
    unused = torch.ones(out.shape[0], dtype=torch.bool)
    unused[rows.cpu().flatten()] = False
    assert torch.all(o.grad.cpu()[unused] == 0)
    # deterministic
    o2, w2 = out.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = combine_triton(o2, rows, w2)
    y2.backward(dy)
    assert torch.equal(y, y2) and torch.equal(o.grad, o2.grad) and torch.equal(wt.grad, w2.grad)


def test_combine_k1_single_token():
    out, rows, w, dy = make_combine(T=1, K=1, D=5, dropped=0.0, dtype=torch.float32)
    o, wt = out.clone().requires_grad_(), w.clone().requires_grad_()
    combine_triton(o, rows, wt).backward(dy)
    assert_close(o.grad[rows[0, 0]], w[0, 0] * dy[0], torch.float32, "d_out")
    assert_close(wt.grad[0, 0], (dy[0] * out[rows[0, 0]]).sum(), torch.float32, "d_w")


# ----------------------------------------------------------------------------- pieces
def test_rows_to_tokens():
    """The backward of gather-on-load: a deterministic gather-sum over the inverse map."""
    g = torch.Generator().manual_seed(1)
    M, D, T, live = 37, 20, 9, 31
    src = torch.randn(M, D, generator=g).to(DEVICE)
    ids = torch.randint(0, T - 2, (M,), generator=g).to(DEVICE)  # tokens T-2, T-1 get no rows
    got = rows_to_tokens(src, ids, torch.tensor(live, device=DEVICE), T)
    ref = torch.zeros(T, D, dtype=torch.float64).index_add_(
        0, ids[:live].cpu(), src[:live].double().cpu()
    )
    assert_close(got, ref, torch.float32, "rows_to_tokens")
    assert torch.all(got[T - 2 :] == 0)


@pytest.mark.parametrize(
    "counts,tail",
    [([5, 0, 17, 2], 3), ([40], 0), ([0, 0, 0], 4), ([16, 16], 0), ([0] * 511 + [70], 9)],
)
def test_tile_schedule(counts, tail):
    block = 16
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    M, E = sum(counts) + tail, len(counts)
    got = tile_schedule(offsets, M, block).cpu().tolist()
    want, start = [], 0
    for s, n in enumerate(counts + [tail]):
        want += [[s, r, start + n] for r in range(start, start + n, block)]
        start += n
    assert got[: len(want)] == want
    assert all(row[0] > E for row in got[len(want) :]), "tiles past the real count must exit"


def test_backend_selection(monkeypatch):
    x = torch.zeros(2, 2)
    assert resolve_backend("auto", x) == "torch"
    if HAS_CUDA:
        assert resolve_backend("auto", x.cuda()) == "triton"
    with pytest.raises(ValueError, match="backend="):
        resolve_backend("cutlass", x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = make_case([3, 2], 0, 8, 8, "relu", False, False)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    with pytest.raises(ValueError, match="CUDA"):
        expert_mlp(
            cpu["x"], cpu["offsets"], cpu["w1"], cpu["w2"], activation="relu", kernel="triton"
        )


def test_shape_errors():
    case = make_case([3, 2], 0, 8, 8, "swiglu", False, True)
    args = dict(activation="swiglu", rows=ExpertRows(gather_ids_R=case["ids"]), kernel="triton")
    with pytest.raises(ValueError, match="w2_LFD"):
        expert_mlp(case["x"], case["offsets"], case["w1"], case["w2"][:, :4], case["w3"], **args)
    with pytest.raises(ValueError, match="offsets_L"):
        expert_mlp(case["x"], case["offsets"][:1], case["w1"], case["w2"], case["w3"], **args)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter mode switching is a CPU-only concern")
def test_kernels_follow_interpret_mode(monkeypatch):
    """Kernel modules imported in compiled mode are re-decorated once TRITON_INTERPRET=1 is set."""
    from moe.kernels.triton import lang as triton_lang

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    triton_common.ensure_mode()
    assert triton_lang.BUILT_INTERPRETED is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_case(make_case([4, 0, 9], 1, 16, 16, "relu", False, True))
    assert triton_lang.BUILT_INTERPRETED is True


def test_torch_compile():
    """Custom ops trace under torch.compile (fake tensors + registered autograd)."""
    case = make_case([6, 0, 11], 2, 24, 40, "swiglu", True, True, T=10)
    T, K = 9, 2  # 18 pairs on 19 rows: each row used at most once
    pair_rows = torch.arange(T * K, device=DEVICE).view(T, K)
    weights = torch.rand(T, K, device=DEVICE)

    def layer(x, w1, w2, w3, b1, b2, weights):
        out = expert_mlp(x, case["offsets"], w1, w2, w3, b1, b2, activation="swiglu",
                         rows=ExpertRows(gather_ids_R=case["ids"]), kernel="triton")  # fmt: skip
        return combine_triton(out, pair_rows, weights)

    results = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        leaves = [case[k].clone().requires_grad_() for k in PARAMS] + [
            weights.clone().requires_grad_()
        ]
        y = fn(*leaves)
        y.square().sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_opcheck():
    import torch.library

    case = make_case([3, 0, 5], 1, 16, 16, "gelu", True, True)
    rw = torch.rand(case["ids"].shape[0], device=DEVICE, requires_grad=True)
    for weights, fused in ((None, False), (rw, True)):
        args = (case["x"].requires_grad_(), case["offsets"], case["w1"].requires_grad_(),
                case["w2"], None, case["b1"], case["b2"], case["ids"], weights, None, "gelu",
                True, fused)  # fmt: skip
        torch.library.opcheck(torch.ops.moe.triton_expert_mlp.default, args)


def test_kernels_compile_for_sm90():
    """Lower every kernel role to sm_90 PTX/cubin without a GPU (the interpreter never does):
    catches type errors the interpreter tolerates, and checks the GEMMs use wgmma."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    # one shape, first configs: .ci/run runs the full check (four shapes, every config)
    cmd = [sys.executable, "-m", "tools.triton_aot_check", "--shapes", "mixtral", "--first"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


# ----------------------------------------------------------------------------- CUDA only
@NEEDS_CUDA
def test_cuda_graph_capture():
    """No host sync anywhere in forward and backward: the whole step captures into a graph."""
    case = make_case(
        [300, 0, 500, 200], 24, 256, 512, "swiglu", True, True, dtype=torch.bfloat16, T=600
    )
    leaves = [case[k].clone().requires_grad_() for k in PARAMS]
    step = lambda: expert_mlp(leaves[0], case["offsets"], *leaves[1:], activation="swiglu",
                              rows=ExpertRows(gather_ids_R=case["ids"]), kernel="triton")  # fmt: skip
    side = torch.cuda.Stream()  # warm up (autotune, compile) on a side stream, as torch asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step().backward(case["dy"])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        out = step()
        out.backward(case["dy"])
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_grads = run_triton(case)
    assert torch.equal(out, ref_out)
    for k, t in zip(PARAMS, leaves):
        assert torch.equal(t.grad, ref_grads[k])


@NEEDS_CUDA
def test_cuda_int64_offsets():
    """x with more than 2**31 elements: the gathered rows live past the int32 range."""
    T, D, F = (1 << 31) // 2048 + 64, 2048, 64
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(T - 48, T, device="cuda")
    offsets = torch.tensor([20, 48], dtype=torch.int32, device="cuda")
    w1 = torch.randn(2, D, F, device="cuda", dtype=torch.bfloat16) * D**-0.5
    w2 = torch.randn(2, F, D, device="cuda", dtype=torch.bfloat16) * F**-0.5
    got = expert_mlp(
        x, offsets, w1, w2, activation="relu", rows=ExpertRows(gather_ids_R=ids), kernel="triton"
    )
    ref = expert_mlp(
        x, offsets, w1, w2, activation="relu", rows=ExpertRows(gather_ids_R=ids), kernel="torch"
    )
    assert_close(got, ref.float(), torch.bfloat16, "int64 offsets")


@pytest.mark.parametrize(
    "options",
    [
        {"capacity_factor": None, "activation": "gelu"},
        {"capacity_factor": 0.7, "activation": "swiglu"},
        {"capacity_factor": 1.0, "activation": "relu", "bias": True},
    ],
)
def test_layer_on_triton_backend_matches_per_token_reference(options):
    """The whole MoELayer (gather on load, fused epilogues, combine) on the Triton backend."""
    import moe
    from tests.test_layer import check_against_reference

    torch.manual_seed(0)
    layer = moe.MoELayer(16, 24, 4, top_k=2, backend="triton", **options).to(DEVICE)
    check_against_reference(layer, torch.randn(13, 16, device=DEVICE))
