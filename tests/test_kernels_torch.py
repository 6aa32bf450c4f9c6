"""Torch-path kernels (moe::grouped_mm, moe::grouped_mm_wgrad, moe::combine, expert_mlp)
against float64 per-row references: outputs and every gradient, awkward sizes; opcheck;
gradcheck of the whole layer in float64; torch.compile of the layer equals eager."""

import pytest
import torch

import moe
from moe.kernels import combine, expert_mlp, grouped_mm_torch
from moe.kernels.expert_rows import ExpertRows
from tests import reference as ref

# (rows per expert, tail rows past the last offset): T=1, empty experts, all rows to one
# expert, dropped tail rows.
LAYOUTS = [([1], 0), ([0, 3, 0, 2], 0), ([0, 0, 5, 0], 0), ([2, 0, 3], 2), ([0, 0], 3)]


def offsets_of(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def experts_of_rows(counts, tail):
    ids = [e for e, n in enumerate(counts) for _ in range(n)]
    return ids + [None] * tail


def expert_params(E, D, F, activation, bias, dtype):
    """Random expert weights (leaves) by name, and the same as expert_mlp's keyword args."""
    params = {
        "w1": torch.randn(E, D, F, dtype=dtype) / 3,
        "w2": torch.randn(E, F, D, dtype=dtype) / 3,
        "w3": torch.randn(E, D, F, dtype=dtype) / 3 if activation == "swiglu" else None,
        "b1": torch.randn(E, F, dtype=dtype) if bias else None,
        "b2": torch.randn(E, D, dtype=dtype) if bias else None,
    }
    params = {n: p.requires_grad_() for n, p in params.items() if p is not None}
    suffix = dict(w1="LDF", w2="LFD", w3="LDF", b1="LF", b2="LD")
    return params, {f"{n}_{suffix[n]}": p for n, p in params.items()}


@pytest.mark.parametrize("counts,tail", LAYOUTS)
@pytest.mark.parametrize("dtype,K,N", [(torch.float32, 16, 8), (torch.float32, 5, 7),
                                       (torch.float64, 4, 8)])  # fmt: skip
def test_grouped_mm_matches_per_row_reference(counts, tail, dtype, K, N):
    torch.manual_seed(len(counts) * 31 + tail + K)
    rows = experts_of_rows(counts, tail)
    x = torch.randn(len(rows), K, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), K, N, dtype=dtype, requires_grad=True)
    dy = torch.randn(len(rows), N, dtype=dtype)
    y = grouped_mm_torch(x, w, offsets_of(counts))
    y.backward(dy)
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    yr = torch.stack(
        [xr[m] @ wr[e] if e is not None else xr[m] @ wr[0] * 0 for m, e in enumerate(rows)]
    ) if rows else xr.new_zeros(0, N)  # fmt: skip
    yr.backward(dy.double())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=0)
    torch.testing.assert_close(y.double(), yr, **tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
    torch.testing.assert_close(w.grad.double(), wr.grad, **tol)
    if tail:
        assert torch.equal(y[-tail:], torch.zeros_like(y[-tail:]))


@pytest.mark.parametrize("activation,bias", [("gelu", True), ("swiglu", False), ("relu", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expert_mlp_matches_per_token_reference(activation, bias, dtype):
    torch.manual_seed(3)
    counts, tail, T, D, F = [2, 0, 4], 1, 5, 6, 9  # unaligned widths, an empty expert
    E, M = len(counts), sum(counts) + tail
    rows = experts_of_rows(counts, tail)
    x = torch.randn(T, D, dtype=dtype, requires_grad=True)
    token_ids = torch.randint(0, T, (M,))
    params, kw = expert_params(E, D, F, activation, bias, dtype)
    out = expert_mlp(x, offsets_of(counts), **kw, activation=activation,
                     rows=ExpertRows(gather_ids_R=token_ids), kernel="torch")  # fmt: skip
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *params.values()], dy)
    xr = x.detach().double().requires_grad_()
    pr = {n: p.detach().double().requires_grad_() for n, p in params.items()}
    outr = torch.stack([
        ref.expert_ffn(xr[token_ids[m]], e, pr["w1"], pr["w2"], pr.get("w3"), pr.get("b1"),
                       pr.get("b2"), activation) if e is not None else xr.new_zeros(D)
        for m, e in enumerate(rows)
    ])  # fmt: skip
    grads_r = torch.autograd.grad(outr, [xr, *pr.values()], dy.double())
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out.double(), outr, **tol)
    for name, g, gr in zip(["x", *params], grads, grads_r):
        torch.testing.assert_close(g.double(), gr, **tol, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(grads[1][1], torch.zeros_like(grads[1][1]))  # empty expert: exactly 0


@pytest.mark.parametrize("T,K,dtype", [(1, 1, torch.float64), (5, 3, torch.float32)])
def test_combine_matches_reference(T, K, dtype):
    torch.manual_seed(T + K)
    D = 7
    out = torch.randn(T * K, D, dtype=dtype, requires_grad=True)
    pair_rows = torch.randperm(T * K).view(T, K)
    w = torch.rand(T, K, dtype=torch.float32, requires_grad=True)
    y = combine(out, pair_rows, w)
    dy = torch.randn_like(y)
    g_out, g_w = torch.autograd.grad(y, [out, w], dy)
    outr, wr = out.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = torch.stack([sum(wr[t, j] * outr[pair_rows[t, j]] for j in range(K)) for t in range(T)])
    gr_out, gr_w = torch.autograd.grad(yr, [outr, wr], dy.double())
    torch.testing.assert_close(y.double(), yr, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_out.double(), gr_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_w.double(), gr_w, atol=1e-5, rtol=1e-5)
    assert g_w.dtype == w.dtype


def test_opcheck_custom_ops():
    torch.manual_seed(0)
    offsets = offsets_of([2, 0, 3])
    for dtype, K in [(torch.float32, 8), (torch.float64, 5)]:
        x = torch.randn(6, K, dtype=dtype, requires_grad=True)
        w = torch.randn(3, K, 4, dtype=dtype, requires_grad=True)
        dy = torch.randn(6, 4, dtype=dtype, requires_grad=True)
        torch.library.opcheck(torch.ops.moe.grouped_mm.default, (x, w, offsets))
        torch.library.opcheck(torch.ops.moe.grouped_mm_wgrad.default, (x, dy, offsets))
    out = torch.randn(6, 5, requires_grad=True)
    pair_rows = torch.randperm(6).view(3, 2)
    w = torch.rand(3, 2, requires_grad=True)
    torch.library.opcheck(torch.ops.moe.combine.default, (out, pair_rows, w))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layer_gradcheck_float64(activation):
    torch.manual_seed(1)
    layer = moe.MoELayer(6, 5, 4, top_k=2, activation=activation, bias=activation == "gelu")
    layer = layer.double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    params = [p for p in layer.parameters() if p.requires_grad]

    def f(x, *ps):
        with torch.nn.utils.stateless._reparametrize_module(  # noqa: SLF001
            layer, dict(zip([n for n, p in layer.named_parameters() if p.requires_grad], ps))
        ):
            return layer(x)

    assert torch.autograd.gradcheck(f, (x, *params), atol=1e-6, rtol=1e-5)


def _fwd_bwd(module, x):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.float().square().sum().backward()
    return y, x.grad, [p.grad for p in module.parameters() if p.requires_grad]


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_compiled_layer_equals_eager(fullgraph, mode):
    # aot_eager runs dynamo + AOT autograd over the fake registrations; inductor's C++ build
    # takes minutes on CI's two cores (checked by hand, see the speed report).
    torch.manual_seed(2)
    torch._dynamo.reset()
    layer = moe.MoELayer(16, 32, 4, top_k=2, activation="swiglu", capacity_factor=None)
    x = torch.randn(9, 16)
    if mode == "bf16":
        layer, x = layer.to(torch.bfloat16), x.to(torch.bfloat16)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=fullgraph)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else _null()
    with ctx:
        y_c, gx_c, gp_c = _fwd_bwd(compiled, x)
        y_e, gx_e, gp_e = _fwd_bwd(layer, x)
    tol = dict(atol=2e-2, rtol=2e-2) if mode != "fp32" else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y_c, y_e, **tol)
    torch.testing.assert_close(gx_c, gx_e, **tol)
    for a, b in zip(gp_c, gp_e):
        torch.testing.assert_close(a, b, **tol)


def _null():
    import contextlib

    return contextlib.nullcontext()


# The fused moe::expert_mlp paths: folded combine weights, the sum into tokens, several chunks,
# equal groups (one bmm), tail rows, no gather index.
FUSED_CASES = {  # name: (rows per expert, tail rows, gather index, row weights, sum_to_tokens)
    "ragged_tail_weights_sum": ([3, 0, 5, 2], 2, True, True, True),
    "ragged_rows_weights": ([1, 4, 0, 2], 1, True, True, False),
    "equal_groups_bmm_sum": ([3, 3, 3], 0, True, True, True),
    "no_gather_rows": ([2, 5, 1], 1, False, False, False),
}


# chunk bytes: one expert per chunk; one chunk (equal groups run as one bmm); the device path
# (one chunk of all rows, tail rows included, no host reads)
LAYOUT_MODES = {"expert_per_chunk": 1, "one_chunk": 1 << 20, "device": None}


@pytest.mark.parametrize("layout", list(LAYOUT_MODES))
@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("activation,bias,dtype", [("gelu", True, torch.float64),
                                                   ("swiglu", False, torch.float32),
                                                   ("silu", True, torch.float32)])  # fmt: skip
def test_fused_expert_mlp_matches_per_row_reference(
    monkeypatch, layout, case, activation, bias, dtype
):
    import moe.kernels.expert_chunks as expert_chunks

    if LAYOUT_MODES[layout] is None:
        monkeypatch.setattr(expert_chunks, "host_readable", lambda t: False)
    else:
        monkeypatch.setattr(expert_chunks, "CHUNK_BYTES", LAYOUT_MODES[layout])
    counts, tail, with_ids, with_weights, sum_to_tokens = FUSED_CASES[case]
    torch.manual_seed(len(case) + len(activation))
    E, R, T, D, F = len(counts), sum(counts) + tail, 6, 5, 7  # unaligned widths
    rows = experts_of_rows(counts, tail)
    ids = torch.randint(0, T, (R,)) if with_ids else None
    x = torch.randn(T if with_ids else R, D, dtype=dtype, requires_grad=True)
    rw = torch.rand(R, dtype=dtype, requires_grad=True) if with_weights else None
    params, kw = expert_params(E, D, F, activation, bias, dtype)
    rows_info = ExpertRows(gather_ids_R=ids, row_weights_R=rw, sum_to_tokens=sum_to_tokens)
    out = expert_mlp(x, offsets_of(counts), **kw, activation=activation, rows=rows_info,
                     kernel="torch")  # fmt: skip
    leaves = [x, *params.values()] + ([rw] if rw is not None else [])
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dy)

    xr = x.detach().double().requires_grad_()
    pr = {n: p.detach().double().requires_grad_() for n, p in params.items()}
    rwr = rw.detach().double().requires_grad_() if rw is not None else None
    row_out = []
    for r, e in enumerate(rows):
        src = xr[ids[r]] if ids is not None else xr[r]
        y = ref.expert_ffn(src, e, pr["w1"], pr["w2"], pr.get("w3"), pr.get("b1"),
                           pr.get("b2"), activation) if e is not None else xr.new_zeros(D)  # fmt: skip
        row_out.append(y * rwr[r] if rwr is not None else y)
    if sum_to_tokens:
        outr = torch.stack([sum((row_out[r] for r in range(R) if ids[r] == t),
                                xr.new_zeros(D)) for t in range(T)])  # fmt: skip
    else:
        outr = torch.stack(row_out)
    leaves_r = [xr, *pr.values()] + ([rwr] if rwr is not None else [])
    want = torch.autograd.grad(outr, leaves_r, dy.double())
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out.double(), outr, **tol)
    names = ["x", *params] + (["row_weights"] if rw is not None else [])
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m, n=name: f"{n}: {m}")
    if not sum_to_tokens and tail:
        assert torch.equal(out[-tail:], torch.zeros_like(out[-tail:]))
    if 0 in counts:  # an expert without rows: exactly zero weight gradient
        assert torch.equal(got[1][counts.index(0)], torch.zeros_like(got[1][0]))


def test_all_rows_kept_skips_the_tail_fill_on_the_device_path(monkeypatch):
    """Rows an expert-parallel exchange delivers have no dropped tail (ExpertRows.all_rows_kept):
    the device path (one chunk, no host read) then runs no masked zero-fill over the output,
    and the result equals the path that does fill."""
    import moe.kernels.expert_chunks as expert_chunks
    import moe.kernels.torch_expert_mlp as torch_expert_mlp

    for module in (expert_chunks, torch_expert_mlp):  # as on CUDA: no host read
        monkeypatch.setattr(module, "host_readable", lambda t: False)
    torch.manual_seed(7)
    counts, D, F = [3, 0, 5, 2], 6, 5
    x = torch.randn(sum(counts), D, requires_grad=True)
    params, kw = expert_params(len(counts), D, F, "swiglu", True, torch.float32)
    fills = []
    real_fill = torch_expert_mlp.zero_tail_rows
    monkeypatch.setattr(
        torch_expert_mlp, "zero_tail_rows", lambda y, o: fills.append(1) or real_fill(y, o)
    )
    outs = []
    for kept in (False, True):
        rows = ExpertRows(all_rows_kept=kept)
        out = expert_mlp(x, offsets_of(counts), **kw, activation="swiglu", rows=rows)
        outs.append((out, torch.autograd.grad(out.sum(), [x, *params.values()])))
        assert fills == [1], fills  # the kept=False call filled; the kept=True call did not
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    for g_kept, g_fill in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(g_kept, g_fill, rtol=0, atol=0)


def test_fused_expert_mlp_is_deterministic_and_passes_opcheck():
    torch.manual_seed(5)
    counts, T, D, F = [4, 0, 7, 3], 6, 8, 4
    R = sum(counts)
    x = torch.randn(T, D, requires_grad=True)
    w1, w2 = torch.randn(4, D, F, requires_grad=True), torch.randn(4, F, D, requires_grad=True)
    ids, rw = torch.randint(0, T, (R,)), torch.rand(R, requires_grad=True)
    args = (x, offsets_of(counts), w1, w2, None, None, None, ids, rw, "gelu", True)
    runs = []
    for _ in range(2):
        out = torch.ops.moe.expert_mlp(*args)[0]
        runs.append(torch.autograd.grad(out.square().sum(), [x, w1, w2, rw]))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    torch.library.opcheck(torch.ops.moe.expert_mlp.default, args)
    with pytest.raises(NotImplementedError, match="no double backward"):
        out = torch.ops.moe.expert_mlp(*args)[0]
        (g,) = torch.autograd.grad(out.sum(), [w1], create_graph=True)


@pytest.mark.parametrize("router", ["topk", "expert_choice"])
def test_default_compile_has_no_graph_break(router):
    """The layer compiles as one graph in torch.compile's default mode too (no data-dependent
    output shapes, no host reads outside the custom ops), forward and backward."""
    from torch._dynamo.utils import counters

    torch.manual_seed(4)
    torch._dynamo.reset()
    counters.clear()
    layer = moe.MoELayer(16, 24, 4, top_k=2, router=router, capacity_factor=1.5)
    compiled = torch.compile(layer, backend="aot_eager")
    x = torch.randn(11, 16)
    y_c, gx_c, _ = _fwd_bwd(compiled, x)
    y_e, gx_e, _ = _fwd_bwd(layer, x)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(gx_c, gx_e)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu", "swiglu"])
def test_in_place_activation_backward_matches_autograd(activation):
    """activation_backward_ (dh into d(act)'s buffer, dg into silu(h)'s): the same bits as the
    out-of-place form, and the float64 autograd gradient of apply_activation."""
    from moe.kernels.activations import (
        activation_backward,
        activation_backward_,
        apply_activation,
    )

    torch.manual_seed(7)
    h, g, da = (torch.randn(5, 9, dtype=torch.float64) for _ in range(3))
    gate = g if activation == "swiglu" else None
    want = activation_backward(da, h, activation, gate)
    silu = torch.nn.functional.silu(h) if gate is not None else None
    got = activation_backward_(da.clone(), h, activation, gate, silu)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None) == (want[1] is None) and (
        got[1] is None or torch.equal(got[1], want[1])
    )
    hr = h.clone().requires_grad_()
    gr = g.clone().requires_grad_() if gate is not None else None
    ref = torch.autograd.grad(
        apply_activation(hr, activation, gr), [hr] + ([gr] if gr is not None else []), da
    )
    torch.testing.assert_close(got[0], ref[0])
    if gate is not None:
        torch.testing.assert_close(got[1], ref[1])
