"""FP8 grouped GEMM and FP8 expert MLP (moe/fp8/grouped_mm.py, moe/fp8/expert_mlp.py):
exact given the format against the float64 references of tests/fp8_reference.py, and the
format's quality against the float32 torch kernels (SQNR floors of issue 40)."""

import pytest
import torch

from moe.fp8 import FP8Config, fp8_expert_mlp, fp8_grouped_mm
from moe.fp8.grouped_mm import quantize_input
from moe.kernels.expert_rows import ExpertRows
from moe.kernels.torch_expert_mlp import expert_mlp_torch
from moe.kernels.torch_grouped_mm import grouped_mm_torch
from tests.fp8_reference import ref_fp8_mlp, ref_grouped, sqnr


def _close(got, want, what):
    """Equal to float32 rounding: within 5e-7 of the reference's largest magnitude (a
    wrong scale axis or a missing second rounding shows as >= 1e-6)."""
    err = float((got.detach().double() - want.detach()).abs().max())
    assert err <= 5e-7 * float(want.detach().abs().max()) + 1e-30, f"{what}: max error {err}"


def _uneven(*shape, generator=None):
    """randn with magnitudes spread over rows and columns (e^N(0,1) each), so row, column
    and per-expert scales differ (equal power-of-two scales would hide a wrong axis)."""
    g = generator
    x = torch.randn(*shape, generator=g)
    return (
        x
        * torch.randn(shape[0], 1, generator=g).exp()
        * torch.randn(1, shape[1], generator=g).exp()
    )


def _grads(fn, tensors, dy):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy)
    return [y] + [t.grad for t in leaves]


# K=37, N=21: unaligned (per-expert fallback); K=40, N=24: torch._grouped_mm's path
@pytest.mark.parametrize("K, N", [(37, 21), (40, 24)])
@pytest.mark.parametrize("pow2, save_fp8", [(True, True), (False, False)])
def test_grouped_mm_equals_the_float64_reference(K, N, pow2, save_fp8):
    torch.manual_seed(K + N)
    offsets = torch.tensor([0, 7, 7, 19], dtype=torch.int32)  # empty experts 0 and 2
    x = _uneven(23, K)  # rows 19-22: dropped tail
    w = torch.randn(4, K, N)
    dy = _uneven(23, N)
    got = _grads(lambda a, b: fp8_grouped_mm(a, b, offsets, pow2=pow2, save_fp8=save_fp8),
                 (x, w), dy)  # fmt: skip
    want = _grads(lambda a, b: ref_grouped(a, b, offsets, pow2, save_fp8),
                  (x.double(), w.double()), dy.double())  # fmt: skip
    for g, r, what in zip(got, want, ("y", "dx", "dw")):
        _close(g, r, what)
    assert (got[0][19:] == 0).all() and (got[1][19:] == 0).all()
    assert (got[2][0] == 0).all() and (got[2][2] == 0).all()


def test_blockwise_grouped_mm_equals_the_float64_reference(pow2=False):
    """fp32 scales (the pow2 form is the MLP test's). Partial 1 x 128 and 128 x 128 blocks (K = 130, N = 140), an expert of 130 rows (two
    token tiles, the second partial), empty experts, dropped tail rows."""
    torch.manual_seed(7)
    offsets = torch.tensor([0, 130, 130, 160], dtype=torch.int32)
    x, w, dy = _uneven(165, 130), torch.randn(4, 130, 140), _uneven(165, 140)
    fp8 = lambda a, b: fp8_grouped_mm(a, b, offsets, pow2=pow2, recipe="blockwise")  # noqa: E731
    got = _grads(fp8, (x, w), dy)
    ref = lambda a, b: ref_grouped(a, b, offsets, pow2, True, "blockwise")  # noqa: E731
    want = _grads(ref, (x.double(), w.double()), dy.double())
    for g, r, what in zip(got, want, ("y", "dx", "dw")):
        _close(g, r, what)
    assert (got[0][160:] == 0).all() and (got[1][160:] == 0).all() and (got[2][2] == 0).all()


def test_grouped_mm_keeps_dtypes_and_refuses_bad_shapes():
    offsets = torch.tensor([3, 6], dtype=torch.int32)
    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, 32, 16, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_grouped_mm(x, w, offsets)
    y.sum().backward()
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    for recipe in ("rowwise", "blockwise"):  # no rows at all
        x0 = torch.randn(0, 32, requires_grad=True)
        y0 = fp8_grouped_mm(x0, w, torch.zeros(2, dtype=torch.int32), recipe=recipe)
        y0.sum().backward()
        assert y0.shape == (0, 16) and x0.grad.shape == (0, 32)
    with pytest.raises(ValueError, match="equal K"):
        fp8_grouped_mm(x, w.transpose(1, 2), offsets)
    with pytest.raises(ValueError, match="offsets_E must be"):
        fp8_grouped_mm(x, w, offsets[:1])


def _mlp_inputs(T, D, F, L, K, offsets, seed, bias_scale=1.0, uneven=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = _uneven(T, D, generator=g) if uneven else r(T, D)
    w1, w2, w3 = r(L, D, F) / D**0.5, r(L, F, D) / F**0.5, r(L, D, F) / D**0.5
    b1, b2 = r(L, F) * bias_scale, r(L, D) * bias_scale
    ids = torch.randint(0, T, (T * K,), generator=g)
    rw = torch.rand(T * K, generator=g)
    return x, w1, w2, w3, b1, b2, ids, rw, (_uneven(T, D, generator=g) if uneven else r(T, D))


def _fp8_mlp(config):
    def run(x, w1, w2, w3, b1, b2, rw, *, offsets, ids):
        rows = ExpertRows(gather_ids_R=ids, row_weights_R=rw, sum_to_tokens=True)
        return fp8_expert_mlp(x, offsets, w1, w2, w3, b1, b2, activation="swiglu", rows=rows,
                              config=config)  # fmt: skip

    return run


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_expert_mlp_equals_the_float64_reference(recipe):
    """Awkward sizes: D = 130 (not a multiple of 128), an expert without rows, dropped tail
    rows (pairs past offsets[-1]); outputs and every gradient."""
    T, D, F, L, K = 11, 130, 36, 3, 2
    offsets = torch.tensor([6, 6, 19], dtype=torch.int32)  # 22 pairs: 3 dropped
    x, w1, w2, w3, b1, b2, ids, rw, dy = _mlp_inputs(T, D, F, L, K, offsets, seed=3)
    run = _fp8_mlp(FP8Config(experts=True, recipe=recipe))
    got = _grads(lambda *a: run(*a, offsets=offsets, ids=ids), (x, w1, w2, w3, b1, b2, rw), dy)

    def ref(x, w1, w2, w3, b1, b2, rw):
        return ref_fp8_mlp(x, offsets, w1, w2, w3, b1, b2, ids, rw, recipe=recipe)

    want = _grads(ref, [t.double() for t in (x, w1, w2, w3, b1, b2, rw)], dy.double())
    for g, r, what in zip(got, want, ("y", "dx", "dw1", "dw2", "dw3", "db1", "db2", "drw")):
        _close(g, r, what)
    assert (got[2][1] == 0).all() and (got[6][19:] == 0).all()  # empty expert, dropped pairs


def test_expert_mlp_contract_rows_out_and_refusals():
    """Without sum_to_tokens the rows come back (tail rows zero) in x's dtype; non-float
    inputs and a missing w3 are refused with one clear error."""
    offsets = torch.tensor([2, 5], dtype=torch.int32)
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    w1, w2 = torch.randn(2, 32, 16, dtype=torch.bfloat16), torch.randn(2, 16, 32)
    out = fp8_expert_mlp(x, offsets, w1, w2.bfloat16(), activation="gelu")
    assert out.shape == (7, 32) and out.dtype == torch.bfloat16 and (out[5:] == 0).all()
    with pytest.raises(ValueError, match="recipe must be one of"):
        fp8_grouped_mm(x, w1, offsets, recipe="tensorwise")
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        fp8_expert_mlp(x.long(), offsets, w1, w2)
    with pytest.raises(ValueError, match="needs w3"):
        fp8_expert_mlp(x, offsets, w1, w2, activation="swiglu")


QUALITY = [(0, "rowwise"), (1, "rowwise"), (2, "rowwise"), (3, "blockwise")]


@pytest.mark.parametrize("seed, recipe", QUALITY)
def test_quality_one_grouped_gemm(seed, recipe):
    """>= 27 dB on the output, >= 26 dB on both gradients, against the float32 GEMM."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([30, 30, 70, 128], dtype=torch.int32)
    x, w = torch.randn(128, 512, generator=g), torch.randn(4, 512, 128, generator=g)
    dy = torch.randn(128, 128, generator=g)
    got = _grads(lambda a, b: fp8_grouped_mm(a, b, offsets, recipe=recipe), (x, w), dy)
    want = _grads(lambda a, b: grouped_mm_torch(a, b, offsets), (x, w), dy)
    db = [sqnr(r, q) for q, r in zip(got, want)]
    print(f"grouped GEMM {recipe} seed {seed}: SQNR dB y, dx, dw = {db}")
    assert db[0] >= 27 and db[1] >= 26 and db[2] >= 26, db


@pytest.mark.parametrize("seed, recipe", QUALITY)
def test_quality_whole_swiglu_mlp(seed, recipe):
    """Every GEMM FP8: >= 22 dB on the output and every gradient, against the float32 torch
    kernel with the same weights and routing (d = 512)."""
    T, D, F, L, K = 64, 512, 128, 4, 2
    offsets = torch.tensor([30, 30, 90, 128], dtype=torch.int32)
    x, w1, w2, w3, b1, b2, ids, rw, dy = _mlp_inputs(
        T, D, F, L, K, offsets, seed, 0.1, uneven=False
    )

    def torch_mlp(x, w1, w2, w3, b1, b2, rw):
        rows = ExpertRows(gather_ids_R=ids, row_weights_R=rw, sum_to_tokens=True)
        return expert_mlp_torch(x, offsets, w1, w2, w3, b1, b2, activation="swiglu", rows=rows)

    args = (x, w1, w2, w3, b1, b2, rw)
    cfg = FP8Config(experts=True, recipe=recipe)
    got = _grads(lambda *a: _fp8_mlp(cfg)(*a, offsets=offsets, ids=ids),
                 args, dy)  # fmt: skip
    want = _grads(torch_mlp, args, dy)
    db = [sqnr(r, q) for q, r in zip(got, want)]
    print(f"swiglu MLP {recipe} seed {seed}: SQNR dB y, dx, dw1, dw2, dw3, db1, db2, drw = {db}")
    assert min(db) >= 22, db


def test_ops_pass_opcheck():
    """Schema, fake (meta) and autograd registrations agree with the ops (torch.compile's
    view of them)."""
    offsets = torch.tensor([0, 5, 9], dtype=torch.int32)
    x = torch.randn(11, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    dy = torch.randn(11, 8)
    ops, utils = torch.ops.moe, ("test_schema", "test_faketensor", "test_autograd_registration")
    check = lambda op, args: torch.library.opcheck(op, args, test_utils=utils)  # noqa: E731
    for recipe in ("rowwise", "blockwise"):
        check(ops.fp8_grouped_mm, (x, w, offsets, True, 1e-4, True, recipe))
    check(ops.fp8_grouped_mm_dgrad, (dy, w.detach(), offsets, True, 1e-4, "blockwise"))
    check(ops.fp8_grouped_mm_wgrad, (x.detach(), dy, offsets, False, 1e-4, "rowwise"))
    q_dy, s_dy = quantize_input(dy, True, 1e-4, "rowwise")  # the dgrad from dy's row-wise form
    args = (q_dy, s_dy, w.detach(), offsets, True, 1e-4, torch.float32)
    check(ops.fp8_grouped_mm_dgrad_quantized, args)
    want = ops.fp8_grouped_mm_dgrad(dy, w.detach(), offsets, True, 1e-4, "rowwise")
    assert torch.equal(ops.fp8_grouped_mm_dgrad_quantized(*args), want)
    for recipe in ("rowwise", "blockwise"):  # from x's quantized form: the same y
        q, s = quantize_input(x.detach(), True, 1e-4, recipe)
        args = (q, s, w.detach(), offsets, True, 1e-4, recipe, torch.float32)
        check(ops.fp8_grouped_mm_quantized, args)
        y = fp8_grouped_mm(x, w, offsets, recipe=recipe)
        assert torch.equal(ops.fp8_grouped_mm_quantized(*args), y)
    # one compiled call (aot_eager: no inductor build) equals the eager one
    f = torch.compile(lambda a, b: fp8_grouped_mm(a, b, offsets), backend="aot_eager")
    assert torch.equal(f(x, w), fp8_grouped_mm(x, w, offsets))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90+ for e4m3)")
def test_cuda_scaled_grouped_mm_equals_the_emulation():
    """On sm_90+ the forward and dgrad GEMMs run on torch._scaled_grouped_mm; they must equal
    the emulation (same quantized operands) to bf16 output rounding."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm_90+")
    offsets = torch.tensor([0, 64, 64, 200], dtype=torch.int32)
    x, w, dy = torch.randn(256, 512), torch.randn(4, 512, 256), torch.randn(256, 256)
    cpu = _grads(
        lambda a, b: fp8_grouped_mm(a, b, offsets), (x.bfloat16(), w.bfloat16()), dy.bfloat16()
    )
    dev = _grads(
        lambda a, b: fp8_grouped_mm(a, b, offsets.cuda()),
        (x.bfloat16().cuda(), w.bfloat16().cuda()),
        dy.bfloat16().cuda(),
    )
    for c, d in zip(cpu, dev):
        assert sqnr(c.float(), d.float().cpu()) >= 40


def _saved(fn):
    """(dtype, numel) of every tensor autograd keeps for the backward of fn()."""
    kept = []

    def pack(t):
        kept.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return kept


def test_backward_keeps_fp8_inputs():
    """With save_fp8_inputs the grouped GEMM keeps x as 1 byte per element plus a float32
    scale per row (and w, a parameter); without it, x itself."""
    offsets = torch.tensor([5, 9], dtype=torch.int32)
    x = torch.randn(9, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    fp8 = _saved(lambda: fp8_grouped_mm(x, w, offsets, save_fp8=True))
    assert (torch.uint8, 9 * 64) in fp8 and (torch.float32, 9) in fp8
    assert (torch.bfloat16, 9 * 64) not in fp8
    plain = _saved(lambda: fp8_grouped_mm(x, w, offsets, save_fp8=False))
    assert (torch.bfloat16, 9 * 64) in plain and (torch.uint8, 9 * 64) not in plain


def _kept(fn, inputs):
    """{storage: (dtype, bytes)} autograd keeps for fn()'s backward, inputs excluded."""
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            kept[st.data_ptr()] = (t.dtype, st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(kept.values())


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_expert_mlp_keeps_x_once_in_fp8_and_no_more_than_the_torch_kernel(activation):
    """The FP8 expert MLP keeps x once, per token, as e4m3 + row scales (shared by the up and
    gate GEMMs, gathered again in the backward) and the pre-activations, and recomputes the
    rest: in all no more bytes than the bf16 torch kernel keeps for the same call, x counted
    (issue 40, Build 4)."""
    T, D, F, L, R = 11, 72, 40, 3, 19
    offsets = torch.tensor([6, 6, 17], dtype=torch.int32)  # an empty expert, a dropped tail
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(L, *s, dtype=torch.bfloat16, requires_grad=True) for s in
          ((D, F), (F, D), (D, F))]  # fmt: skip
    rows = ExpertRows(
        gather_ids_R=torch.randint(0, T, (R,)),
        row_weights_R=torch.rand(R, dtype=torch.bfloat16, requires_grad=True),
        sum_to_tokens=True,
    )
    params = [*ws, rows.row_weights_R]
    w3 = ws[2] if activation == "swiglu" else None
    fp8 = _kept(lambda: fp8_expert_mlp(x, offsets, *ws[:2], w3, activation=activation,
                                       rows=rows), params)  # fmt: skip
    bf16 = _kept(lambda: expert_mlp_torch(x, offsets, *ws[:2], w3, activation=activation,
                                          rows=rows), params)  # fmt: skip
    assert [k for k in fp8 if k[0] == torch.uint8] == [(torch.uint8, T * D)]  # x, once
    assert (torch.float32, T * 4) in fp8  # its row scales
    assert not [k for k in fp8 if k[1] in (T * D * 2, R * D * 2)]  # no x or y in bf16
    pre = [(torch.bfloat16, R * F * 2)] * (2 if w3 is not None else 1)
    assert [k for k in fp8 if k[1] == R * F * 2] == pre  # h (and g); the activation: recomputed
    assert sum(b for _, b in fp8) <= sum(b for _, b in bf16), (fp8, bf16)


def test_expert_mlp_keeps_the_down_input_codes_without_row_weight_gradients():
    """Without row weights to differentiate (the layer's FP8 kernel: the combine weighs the
    rows), the backward reads the down GEMM's e4m3 input as the forward made it (R x F bytes +
    row scales kept) and recomputes no activation; the same gradients as recomputing it."""
    T, D, F, L, R = 11, 72, 40, 3, 19
    offsets = torch.tensor([6, 6, 17], dtype=torch.int32)
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(L, *s, dtype=torch.bfloat16, requires_grad=True) for s in
          ((D, F), (F, D), (D, F))]  # fmt: skip
    ids = torch.randint(0, T, (R,))
    rw = torch.rand(R, dtype=torch.bfloat16)

    def run(rw_grad):
        rows = ExpertRows(gather_ids_R=ids, row_weights_R=rw.clone().requires_grad_(rw_grad))
        return fp8_expert_mlp(x, offsets, *ws, activation="swiglu", rows=rows)

    kept = _kept(lambda: run(False), ws)
    assert sorted(k for k in kept if k[0] == torch.uint8) == sorted(
        [(torch.uint8, T * D), (torch.uint8, R * F)]
    )
    grads = []
    for rw_grad in (False, True):
        y = run(rw_grad)
        grads.append(torch.autograd.grad(y.float().square().sum(), [x, *ws]))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_pow2_quantized_operands_are_exact_in_bf16():
    """The CUDA wgrad runs the dequantized per-expert-column operands through bf16 tensor cores:
    an e4m3 value times a power-of-two scale must be exact in bf16 (3 mantissa bits in 7)."""
    from moe.fp8.quant import dequantize_groups, quantize_groups

    offsets = torch.tensor([5, 5, 37, 60], dtype=torch.int32)
    x = torch.randn(64, 48) * torch.logspace(-3, 3, 48)
    x_q = dequantize_groups(*quantize_groups(x, offsets, pow2=True), offsets)
    assert torch.equal(x_q.bfloat16().float(), x_q)
    assert x_q[60:].abs().sum() == 0 and x_q[:60].abs().sum() > 0
    rough = dequantize_groups(*quantize_groups(x, offsets, pow2=False), offsets)
    assert not torch.equal(rough.bfloat16().float(), rough)  # why the path needs pow2
