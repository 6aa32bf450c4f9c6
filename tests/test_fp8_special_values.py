"""FP8 special values (issue 49, items 1, 2, 3, 12 and 15's FP8 part), at the quantizers
(moe/fp8/quant.py), the dispatch payload, the FP8 GEMM and expert MLP, and the layer:

- non-finite in, non-finite out: a block holding Inf or NaN dequantizes to non-finite values
  in every scale format (fp32, pow2, ue8m0) and every scale layout (rows, columns, 1 x 128,
  128 x 128, per expert column, per 128-row tile); the other blocks are untouched; the FP8
  experts' outputs and gradients are non-finite exactly where the unquantized kernel's are;
- magnitude: activations and gradients of any float32 / bf16 magnitude (1 .. 1e-30) keep the
  format's SQNR (the default floor is the smallest amax with a normal float32 scale);
- float16: its largest values survive power-of-two scales (65504 stays 65504, not Inf);
- FP8Config's bounds (amax_floor, block_size) and an FP8Config that turns nothing on are
  refused at construction; FP8 dispatch of no rows works.
"""

import pytest
import torch

import moe
from moe.fp8 import FP8Config, fp8_dispatch, fp8_expert_mlp, fp8_grouped_mm
from moe.fp8 import quant as Q
from moe.fp8.payload import dequantize_payload, pack_rows, quantize_payload, unpack_rows
from moe.kernels.expert_rows import ExpertRows
from moe.kernels.torch_expert_mlp import expert_mlp_torch
from moe.kernels.torch_grouped_mm import grouped_mm_torch
from tests.fp8_reference import ref_blocks, sqnr

FORMATS = ("fp32", "pow2", "ue8m0")
RECIPES = ("rowwise", "blockwise")
INF, NAN = float("inf"), float("nan")
BAD = {"inf": INF, "-inf": -INF, "nan": NAN}


class _Here:
    """An exchange plan that moves nothing (one process)."""

    def run(self, rows):
        return rows.clone()

    def reverse(self):
        return self


# -- 1. non-finite in, non-finite out --------------------------------------------------------


def _quantizers(pow2: bool) -> dict:
    """name -> (x [300, 200] -> its dequantized values, the part of x that shares a scale
    with the element at (1, 5))."""
    offsets = torch.tensor([2, 2, 300], dtype=torch.int32)  # group 0: rows 0-1

    def weight_blocks(x):
        q, s = Q.quantize_weight_blocks(x, 128, pow2)
        return Q.dequantize(q, Q.expand_weight_blocks(s, *x.shape, 128))

    def row_tiles(x):
        q, scales, seg = Q.quantize_row_tiles(x, offsets, 128, pow2)
        return Q.dequantize(q, scales.index_select(0, seg))

    return {
        "rows": (
            lambda x: Q.dequantize(*Q.quantize_along(x, -1, pow2)),
            (slice(1, 2), slice(None)),
        ),
        "columns": (
            lambda x: Q.dequantize(*Q.quantize_along(x.unsqueeze(0), 1, pow2))[0],
            (slice(None), slice(5, 6)),
        ),
        "1x128 blocks": (
            lambda x: Q.dequantize_blocks(*Q.quantize_blocks(x, 128, pow2), 128),
            (slice(1, 2), slice(0, 128)),
        ),
        "128x128 blocks": (weight_blocks, (slice(0, 128), slice(0, 128))),
        "expert columns": (
            lambda x: Q.dequantize_groups(*Q.quantize_groups(x, offsets, pow2), offsets),
            (slice(0, 2), slice(5, 6)),
        ),
        "128-row tiles": (row_tiles, (slice(0, 2), slice(5, 6))),
    }


@pytest.mark.parametrize("bad", BAD, ids=list(BAD))
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
def test_a_non_finite_element_makes_its_block_non_finite_in_every_quantizer(pow2, bad):
    """The whole scale slice holding Inf or NaN comes back non-finite (its scale is Inf or
    NaN: no value in it can be trusted); every other slice equals the clean quantization bit
    for bit. Before issue 49 a power-of-two scale of Inf was 1: the block came back finite."""
    torch.manual_seed(0)
    x = torch.randn(300, 200)
    x_bad = x.clone()
    x_bad[1, 5] = BAD[bad]
    for name, (f, part) in _quantizers(pow2).items():
        got, clean = f(x_bad), f(x)
        assert not torch.isfinite(got[part]).any(), name
        outside = torch.ones(x.shape, dtype=torch.bool)
        outside[part] = False
        assert torch.equal(got[outside], clean[outside]), name


def test_ue8m0_sends_a_non_finite_scale_as_its_nan_byte():
    s = Q.scale_of(torch.tensor([INF, NAN, 0.0, 448.0]), pow2=True)
    assert torch.equal(s[2:], torch.tensor([2.0**-126, 1.0]))
    byte = Q.scales_to_ue8m0(s)
    assert byte.tolist() == [255, 255, 1, 127]
    back = Q.ue8m0_to_scales(byte)
    assert not torch.isfinite(back[:2]).any() and torch.equal(back[2:], s[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dispatch_rows_keep_non_finite_values(fmt, dtype):
    """The dispatch payload (quantize, pack, unpack, dequantize) in every scale format: a
    1 x 128 block holding Inf or NaN arrives non-finite; the other blocks arrive as without
    it. The FP8 gradient exchange (grad_fp8) the same."""
    torch.manual_seed(1)
    x = (torch.randn(3, 300) * 3).to(dtype)

    def wire(t):
        q, s = quantize_payload(t, 128, fmt)
        return dequantize_payload(*unpack_rows(pack_rows(q, s, fmt), 300, fmt), 128, dtype)

    clean = wire(x)
    for bad in BAD.values():
        x_bad = x.clone()
        x_bad[1, 130] = bad
        got = wire(x_bad)
        assert got.dtype == dtype and not torch.isfinite(got[1, 128:256]).any()
        keep = torch.ones(x.shape, dtype=torch.bool)
        keep[1, 128:256] = False
        assert torch.equal(got[keep], clean[keep])
        # the exchange both ways (gradient home in FP8)
        cfg = FP8Config(dispatch=True, scale_format=fmt)
        xl = x_bad.clone().requires_grad_()
        y = fp8_dispatch(xl, _Here(), cfg, grad_fp8=True)
        y.backward(x_bad)
        assert not torch.isfinite(y[1, 128:256]).any() and torch.isfinite(y[keep]).all()
        assert not torch.isfinite(xl.grad[1, 128:256]).any()


def _mlp_case(T=11, D=130, F=36, seed=3):
    """A SwiGLU expert MLP call with awkward sizes (D = 130, an empty expert, dropped pairs)."""
    g = torch.Generator().manual_seed(seed)
    L, offsets = 3, torch.tensor([6, 6, 19], dtype=torch.int32)
    x = torch.randn(T, D, generator=g)
    w1, w2 = torch.randn(L, D, F, generator=g) / D**0.5, torch.randn(L, F, D, generator=g) / F**0.5
    w3 = torch.randn(L, D, F, generator=g) / D**0.5
    b1, b2 = torch.randn(L, F, generator=g) * 0.1, torch.randn(L, D, generator=g) * 0.1
    ids = torch.randint(0, T, (22,), generator=g)
    rw = torch.rand(22, generator=g)
    dy = torch.randn(T, D, generator=g)
    return offsets, ids, (x, w1, w2, w3, b1, b2, rw), dy


def _mlp(config, offsets, ids):
    """(x, w1, w2, w3, b1, b2, rw) -> y_TD: FP8 experts with config, or the torch kernel."""

    def run(x, w1, w2, w3, b1, b2, rw):
        rows = ExpertRows(gather_ids_R=ids, row_weights_R=rw, sum_to_tokens=True)
        if config is None:
            return expert_mlp_torch(x, offsets, w1, w2, w3, b1, b2, activation="swiglu", rows=rows)
        return fp8_expert_mlp(
            x, offsets, w1, w2, w3, b1, b2, activation="swiglu", rows=rows, config=config
        )

    return run


def _grads(fn, tensors, dy):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


NAMES = ("y", "dx", "dw1", "dw2", "dw3", "db1", "db2", "drw")


@pytest.mark.parametrize("bad", ["inf", "nan"])
@pytest.mark.parametrize("where", ["dy", "x"])
@pytest.mark.parametrize("gemm_scale_format", ["pow2", "fp32"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_experts_are_non_finite_where_the_unquantized_experts_are(
    recipe, gemm_scale_format, where, bad
):
    """One Inf or NaN in the upstream gradient (or in the input): the FP8 expert MLP's output
    and every gradient (dx, dw1, dw2, dw3, ...) hold a non-finite value exactly when the
    float32 torch kernel's do. Before issue 49, with the default power-of-two GEMM scales, an
    Inf in dy left dw1, dw2 and dw3 finite."""
    offsets, ids, args, dy = _mlp_case()
    args = list(args)
    token = int(ids[0])  # a token routed to expert 0
    if where == "dy":
        dy = dy.clone()
        dy[token, 7] = BAD[bad]
    else:
        args[0] = args[0].clone()
        args[0][token, 7] = BAD[bad]
    cfg = FP8Config(experts=True, recipe=recipe, gemm_scale_format=gemm_scale_format)
    got = _grads(_mlp(cfg, offsets, ids), args, dy)
    want = _grads(_mlp(None, offsets, ids), args, dy)
    for g, w, name in zip(got, want, NAMES):
        assert bool(torch.isfinite(g).all()) == bool(torch.isfinite(w).all()), name
    assert not any(bool(torch.isfinite(w).all()) for w in want[1:5])  # dx, dw1, dw2, dw3


# -- 2. any magnitude keeps the format's SQNR ---------------------------------------------------

SCALES = [1.0, 1e-8, 1e-20, 1e-30]


def _db(got, want):
    return [sqnr(w, g) for g, w in zip(got, want)]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_small_gradients_keep_the_format_sqnr_through_the_expert_mlp(recipe, dtype, scale):
    """The whole SwiGLU expert MLP with every GEMM FP8 (default FP8Config: pow2 scales), the
    output gradient scaled by 1 .. 1e-30: every gradient keeps >= 22 dB (the floor of
    test_fp8_gemm's quality test at scale 1) against float64 on the same inputs, and their mean
    is within 1 dB of the unscaled run's (a different rounding, not a coarser one). Before
    issue 49 the 1e-4 amax floor took them to ~0 dB at 1e-20 and 1e-30 (gradients this size
    pass 1e-8; the layer test below, with smaller ones, does not)."""
    g = torch.Generator().manual_seed(0)
    T, D, F, L, K = 64, 256, 128, 4, 2
    offsets = torch.tensor([30, 30, 90, 128], dtype=torch.int32)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    args = [r(T, D), r(L, D, F) / D**0.5, r(L, F, D) / F**0.5, r(L, D, F) / D**0.5]
    args += [r(L, F) * 0.1, r(L, D) * 0.1, torch.rand(T * K, generator=g)]
    ids = torch.randint(0, T, (T * K,), generator=g)
    args = [t.to(dtype) for t in args]
    dy = r(T, D)
    cfg = FP8Config(experts=True, recipe=recipe)
    dbs = {}
    for s in {1.0, scale}:
        dy_s = (dy * s).to(dtype)
        got = _grads(_mlp(cfg, offsets, ids), args, dy_s)[1:]
        want = _grads(_mlp(None, offsets, ids), [t.double() for t in args], dy_s.double())[1:]
        dbs[s] = _db(got, want)
    print(f"{recipe} {dtype} dy x {scale:g}: SQNR dB {[round(d, 1) for d in dbs[scale]]}")
    assert min(dbs[scale]) >= 22, dbs[scale]
    quantized = [0, 1, 2, 3, 4, 6]  # db2 is summed from dy unquantized: float rounding only
    mean = {s: sum(d[i] for i in quantized) / len(quantized) for s, d in dbs.items()}
    assert abs(mean[scale] - mean[1.0]) <= 1, dbs


def _layer_grads(fp8, dtype, x, dy):
    """dx and every parameter gradient of a SwiGLU MoE layer (seed 0), weights made in float32
    and cast to dtype (float64: the unquantized reference with the same weights)."""
    torch.manual_seed(0)
    m = moe.MoELayer(64, 96, 4, top_k=2, activation="swiglu", fp8=fp8, dtype=dtype)
    torch.manual_seed(0)
    m32 = moe.MoELayer(64, 96, 4, top_k=2, activation="swiglu")
    state = m32.state_dict()
    m.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})
    x = x.detach().to(dtype).clone().requires_grad_()
    m(x).backward(dy.to(dtype))
    return [x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("scale", SCALES[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_layer_keeps_gradient_sqnr_at_small_output_gradients(dtype, scale):
    """The issue's case: a MoE layer with FP8 experts (default FP8Config), the output gradient
    scaled by 1e-8 .. 1e-30: dx and every weight gradient keep >= 22 dB against the float64
    layer with the same weights, and their mean within 1 dB of the unscaled run. Before issue
    49: dx and dw1 ~13 dB at 1e-8 here, ~0 dB at 1e-10 and below."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    means = {}
    for s in (1.0, scale):
        dy_s = (dy * s).to(dtype)  # the same gradient, rounded to dtype, for both layers
        got = _layer_grads(FP8Config(experts=True), dtype, x, dy_s)
        want = _layer_grads(None, torch.float64, x.to(dtype), dy_s)
        db = _db(got, want)
        print(f"layer {dtype} dy x {s:g}: SQNR dB dx, router, w1, w2, w3 {db}")
        assert min(db) >= 22, (s, db)
        means[s] = sum(db) / len(db)
    assert abs(means[scale] - means[1.0]) <= 1, means


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_small_activations_and_gradients_keep_the_format_sqnr_in_one_gemm(recipe, dtype, scale):
    """One FP8 grouped GEMM: forward with x scaled (y, and dw = x^T dy) and backward with dy
    scaled (dx, dw), by 1 .. 1e-30: the floors of test_fp8_gemm's quality test (27 dB on y,
    26 on the gradients) against float64 on the same inputs."""
    g = torch.Generator().manual_seed(1)
    offsets = torch.tensor([30, 30, 70, 128], dtype=torch.int32)
    x, w = torch.randn(128, 512, generator=g), torch.randn(4, 512, 128, generator=g)
    dy = torch.randn(128, 128, generator=g)
    fp8 = lambda a, b: fp8_grouped_mm(a, b, offsets, recipe=recipe)  # noqa: E731
    ref = lambda a, b: grouped_mm_torch(a, b, offsets)  # noqa: E731
    w = w.to(dtype)
    for xs, dys in ((scale, 1.0), (1.0, scale)):
        xi, dyi = (x * xs).to(dtype), (dy * dys).to(dtype)
        got = _grads(fp8, (xi, w), dyi)
        want = _grads(ref, (xi.double(), w.double()), dyi.double())
        db = _db(got, want)
        print(f"{recipe} {dtype} x x {xs:g}, dy x {dys:g}: SQNR dB y, dx, dw {db}")
        assert db[0] >= 27 and db[1] >= 26 and db[2] >= 26, db


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_small_dispatch_rows_keep_the_format_sqnr(fmt, dtype, scale):
    """Dispatch rows (1 x 128 blocks) of any magnitude: the same SQNR as at scale 1 (within
    1 dB), >= 27 dB, and equal to the float64 reference quantizer."""
    torch.manual_seed(2)
    x = torch.randn(32, 300)
    dbs = []
    for s in (1.0, scale):
        xs = (x * s).to(dtype)
        q, sc = quantize_payload(xs, 128, fmt)
        got = dequantize_payload(*unpack_rows(pack_rows(q, sc, fmt), 300, fmt), 128, torch.float32)
        assert torch.equal(got, ref_blocks(xs, 128, fmt != "fp32").float())
        dbs.append(sqnr(xs.double(), got))
    assert dbs[1] >= 27 and abs(dbs[1] - dbs[0]) <= 1, dbs


def test_zero_and_subnormal_blocks_get_finite_scales():
    """A block of zeros gets the floor's scale (2^-126, a normal float32 and a UE8M0 byte) and
    stays zero; float32 subnormals quantize to finite values, never NaN."""
    x = torch.zeros(3, 256)
    x[1, :128] = 1e-40  # subnormal
    x[2, 128:] = torch.finfo(torch.float32).tiny
    for pow2 in (False, True):
        q, s = Q.quantize_blocks(x, 128, pow2)
        y = Q.dequantize_blocks(q, s, 128)
        assert torch.isfinite(y).all() and (y[0] == 0).all() and (y[2, 128:] == x[2, 128:]).all()
        assert torch.isfinite(s).all() and (s >= 2.0**-126).all()
        assert ((y[1, :128] - 1e-40).abs() <= 1e-41).all()
    assert (Q.scales_to_ue8m0(Q.scale_of(torch.zeros(2), pow2=True)) == 1).all()


# -- 3. float16 -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_float16_largest_values_survive_power_of_two_scales(fmt):
    """65504 (float16's largest) and 65000 come back finite: a power-of-two scale rounds them
    up to 65536, which dequantization saturates to 65504; values below stay within e4m3's
    rounding (1/16)."""
    big = torch.finfo(torch.float16).max
    x = (torch.randn(4, 300) * 100).half()
    x[0, 0], x[1, 200], x[2, :] = big, -big, 65000
    q, s = quantize_payload(x, 128, fmt)
    y = dequantize_payload(*unpack_rows(pack_rows(q, s, fmt), 300, fmt), 128, torch.float16)
    assert torch.isfinite(y).all()
    assert y[0, 0] == big and y[1, 200] == -big
    assert ((y[2].float() - 65000).abs() <= 65000 / 16).all()
    for fq in (Q.fake_quant_rows, Q.fake_quant_blocks):  # the dequantizer itself
        assert torch.isfinite(fq(x, pow2=fmt != "fp32")).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_float16_layer_with_fp8_dispatch_stays_finite_where_the_plain_layer_is(fmt):
    """An fp16 layer whose unquantized output is finite at inputs 65000 and 65504: with FP8
    dispatch its output is finite too and close to the unquantized one (the big rows are
    exact after the wire)."""

    def layer(fp8):
        torch.manual_seed(0)
        m = moe.MoELayer(40, 24, 4, top_k=2, activation="swiglu", fp8=fp8, dtype=torch.float16)
        with torch.no_grad():  # small up/gate weights: the unquantized fp16 output is finite
            m.experts.w1.mul_(1e-3)
            m.experts.w3.mul_(1e-3)
        return m

    x = (torch.randn(5, 40) * 0.1).half()
    x[0, 3], x[1] = 65000, 65504
    plain = layer(None)(x)
    assert torch.isfinite(plain).all()
    y = layer(FP8Config(dispatch=True, scale_format=fmt))(x)
    assert torch.isfinite(y).all()
    assert sqnr(plain[:2].float(), y[:2].float()) >= 20


# -- 12. bounds at construction, no rows ------------------------------------------------------

OUT_OF_RANGE = [
    ("amax_floor", 1e-50, r"in \[448 \* 2\*\*-126"),
    ("amax_floor", 5e-36, r"in \[448 \* 2\*\*-126"),
    ("amax_floor", 1.5, r"in \[448 \* 2\*\*-126 \(5.266e-36\), 1\]"),
    ("amax_floor", 1e29, r"in \[448 \* 2\*\*-126"),
    ("amax_floor", float("nan"), r"in \[448 \* 2\*\*-126"),
    ("block_size", 2**40, r">= 1 and <= 2\*\*20"),
    ("block_size", 2**20 + 1, r">= 1 and <= 2\*\*20"),
    ("block_size", -3, r">= 1 and <= 2\*\*20"),
]


@pytest.mark.parametrize("field, value, allowed", OUT_OF_RANGE)
def test_config_bounds_are_checked_at_construction(field, value, allowed):
    """One ValueError naming the field and its allowed range (before issue 49 amax_floor=1e-50
    turned zero rows to NaN, 1e29 zeroed every output, block_size=2**40 failed at the first
    forward)."""
    with pytest.raises(ValueError, match=rf"FP8Config\.{field} must be .*{allowed}"):
        FP8Config(dispatch=True, **{field: value})


def test_fp8_grouped_mm_checks_its_floor():
    x, w, offsets = torch.randn(4, 8), torch.randn(1, 8, 8), torch.tensor([4], dtype=torch.int32)
    for floor in (1e-50, 0.0, 2.0, float("nan")):
        with pytest.raises(ValueError, match="fp8_grouped_mm: floor must be in"):
            fp8_grouped_mm(x, w, offsets, floor=floor)
    assert torch.isfinite(fp8_grouped_mm(torch.zeros(4, 8), w, offsets, floor=1e-4)).all()


def test_config_bounds_edges_are_accepted_and_a_wide_block_is_the_row():
    for floor in (Q.AMAX_FLOOR, 1e-4, 1.0):
        assert FP8Config(dispatch=True, amax_floor=floor).amax_floor == floor
    assert FP8Config(dispatch=True).amax_floor == Q.AMAX_FLOOR  # the default: the smallest
    c = FP8Config(dispatch=True, block_size=2**20)
    x = torch.randn(3, 300)
    wide = Q.dequantize_blocks(*Q.quantize_blocks(x, c.block_size), c.block_size)
    assert torch.equal(wide, Q.dequantize_blocks(*Q.quantize_blocks(x, 300), 300))
    q, s = quantize_payload(x, c.block_size, "ue8m0")
    assert pack_rows(q, s, "ue8m0").shape == (3, 301)


@pytest.mark.parametrize("D", [40, 300])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_dispatch_of_no_rows(fmt, D):
    """A process with no tokens: the FP8 exchange of a [0, D] buffer both ways, and the FP8
    layer on 0 tokens (before issue 49: 'view Float as Byte' when D <= block_size)."""
    cfg = FP8Config(dispatch=True, scale_format=fmt, grad_before_down_fp8=True)
    x = torch.randn(0, D, requires_grad=True)
    y = fp8_dispatch(x, _Here(), cfg, grad_fp8=True)
    y.sum().backward()
    assert y.shape == (0, D) and x.grad.shape == (0, D)
    layer = moe.MoELayer(D, 24, 4, top_k=2, fp8=cfg)
    x = torch.randn(0, D, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad.shape == (0, D)


# -- 15. an FP8Config that turns nothing on ---------------------------------------------------


def test_fp8_config_with_nothing_on_is_refused():
    for kw in ({}, {"recipe": "blockwise"}, {"scale_format": "ue8m0", "block_size": 64}):
        with pytest.raises(ValueError, match="FP8Config turns nothing on: set FP8Config.dispatch"):
            FP8Config(**kw)
    for on in ("dispatch", "experts", "grad_before_down_fp8"):
        assert getattr(FP8Config(**{on: True}), on)
