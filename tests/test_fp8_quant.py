"""FP8Config validation and the e4m3 quantizers (moe/fp8/config.py, moe/fp8/quant.py)."""

import pytest
import torch

from moe.fp8 import FP8Config
from moe.fp8 import quant as Q
from tests.fp8_reference import ref_blocks, ref_rows

BAD = [
    ("dispatch", 1),
    ("experts", "yes"),
    ("recipe", "tensorwise"),
    ("scale_format", "e5m2"),
    ("gemm_scale_format", "ue8m0"),
    ("block_size", 0),
    ("block_size", 128.0),
    ("grad_before_down_fp8", None),
    ("save_fp8_inputs", 0),
    ("amax_floor", 0.0),
    ("amax_floor", float("inf")),
]


@pytest.mark.parametrize("field, value", BAD)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"FP8Config.{field} "):
        FP8Config(**{field: value})


def test_config_defaults_and_derived_flags():
    c = FP8Config(dispatch=True, scale_format="ue8m0")
    assert c.pow2_dispatch_scales and c.pow2_gemm_scales and c.block_size == 128
    assert not FP8Config(experts=True).pow2_dispatch_scales
    assert not FP8Config(experts=True, gemm_scale_format="fp32").pow2_gemm_scales


def _representable(shape, gen):
    """Random finite e4m3 values (no NaN byte), each row's first element +-448."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x40  # 0x7f / 0xff are NaN in e4m3fn
    v = b.view(Q.E4M3).float()
    v[..., 0] = 448.0 * torch.where(torch.rand(shape[:-1], generator=gen) < 0.5, -1.0, 1.0)
    return v


@pytest.mark.parametrize("pow2", [False, True])
def test_round_trip_is_exact_on_representable_values(pow2):
    gen = torch.Generator().manual_seed(0)
    s_R1 = 2.0 ** torch.randint(-20, 20, (6, 1), generator=gen).float()
    x = _representable((6, 129), gen) * s_R1
    q, s = Q.quantize_along(x, -1, pow2)
    assert torch.equal(s, s_R1) and torch.equal(Q.dequantize(q, s), x)
    # blocks: every 1 x 128 block holds +-448 * its scale
    xb = torch.cat([_representable((6, 128), gen), _representable((6, 72), gen)], 1) * s_R1
    qb, sb = Q.quantize_blocks(xb, 128, pow2)
    assert sb.shape == (6, 2) and torch.equal(Q.dequantize_blocks(qb, sb, 128), xb)
    # 128 x 128 weight blocks and per-group columns
    w = _representable((2, 130, 200), gen).transpose(1, 2) * 0.25  # +-448 in row 0 of each col
    qw, sw = Q.quantize_along(w, 1, pow2)
    assert torch.equal(Q.dequantize(qw, sw), w)
    offsets = torch.tensor([1, 1, 5], dtype=torch.int32)
    xg = _representable((5, 7), gen).t().contiguous()[:, :5].t().contiguous()
    xg = torch.cat([xg[:1], xg[1:]])  # group 0: row 0, group 2: rows 1-4
    xg[1] = 448.0
    qg, sg = Q.quantize_groups(xg, offsets, pow2)
    assert torch.equal(Q.dequantize_groups(qg, sg, offsets), xg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_zeros_stay_zero_and_the_largest_input_does_not_overflow(dtype, pow2):
    big = torch.finfo(dtype).max
    x = torch.randn(4, 300).to(dtype)
    x[0] = 0  # a row (and its blocks) of zeros
    x[1, :128] = 0  # one zero block
    x[2, 5], x[3, 290] = big, -big
    outs = [
        Q.dequantize(*Q.quantize_along(x, -1, pow2)),
        Q.dequantize_blocks(*Q.quantize_blocks(x, 128, pow2), 128),
        Q.dequantize(*Q.quantize_along(x.t().contiguous().unsqueeze(0), 1, pow2))[0].t(),
        Q.dequantize(*_expand_w(*Q.quantize_weight_blocks(x.unsqueeze(0), 128, pow2)))[0],
    ]
    offsets = torch.tensor([2, 2, 4], dtype=torch.int32)
    outs.append(Q.dequantize_groups(*Q.quantize_groups(x, offsets, pow2), offsets))
    for y in outs:
        assert torch.isfinite(y).all()
        assert (y[0] == 0).all() and (y[1, :128] == 0).all()
        assert abs(float(y[2, 5]) / big - 1) <= 1 / 16 and abs(float(y[3, 290]) / big + 1) <= 1 / 16


def _expand_w(q, s):
    return q, Q.expand_weight_blocks(s, q.shape[-2], q.shape[-1])


@pytest.mark.parametrize("D", [1, 128, 300])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantizers_equal_the_naive_loops_at_awkward_sizes(D, pow2):
    torch.manual_seed(D)
    x = torch.randn(3, D) * torch.tensor([[1e-3], [1.0], [1e4]])
    assert torch.equal(Q.dequantize(*Q.quantize_along(x, -1, pow2)), ref_rows(x, pow2).float())
    got = Q.dequantize_blocks(*Q.quantize_blocks(x, 128, pow2), 128)
    assert torch.equal(got, ref_blocks(x, 128, pow2).float())
    w = torch.randn(130, D)
    q, s = Q.quantize_weight_blocks(w, 128, pow2)
    want = torch.empty_like(w, dtype=torch.float64)
    for i in range(0, 130, 128):
        for j in range(0, D, 128):
            blk = w[i : i + 128, j : j + 128]
            want[i : i + 128, j : j + 128] = ref_rows(blk.reshape(1, -1), pow2).view(blk.shape)
    assert torch.equal(Q.dequantize(q, Q.expand_weight_blocks(s, 130, D)), want.float())
    offsets = torch.tensor([0, 2, 2, 3], dtype=torch.int32)  # an empty first and third group
    x4 = torch.cat([x, torch.randn(2, D)])  # two tail rows
    got = Q.dequantize_groups(*Q.quantize_groups(x4, offsets, pow2), offsets)
    want = torch.cat([ref_rows(x4[:2].t(), pow2).t(), ref_rows(x4[2:3].t(), pow2).t()])
    assert torch.equal(got[:3], want.float()) and (got[3:] == 0).all()


@pytest.mark.parametrize("pow2", [False, True])
def test_no_rows(pow2):
    """A rank with nothing to send quantizes an empty [0, D] buffer."""
    x = torch.randn(0, 300)
    q, s = Q.quantize_blocks(x, 128, pow2)
    assert q.shape == (0, 300) and s.shape == (0, 3)
    assert Q.dequantize_blocks(q, s, 128).shape == (0, 300)
    q, s = Q.quantize_along(x, -1, pow2)
    assert q.shape == (0, 300) and s.shape == (0, 1)
    offsets = torch.zeros(2, dtype=torch.int32)
    q, s = Q.quantize_groups(x, offsets, pow2)
    assert q.shape == (0, 300) and s.shape == (2, 300)
    q, s, seg = Q.quantize_row_tiles(x, offsets, 128, pow2)
    assert q.shape == (0, 300) and seg.shape == (0,)


def test_ue8m0_and_pow2_scales():
    s = torch.tensor([2.0**-22, 0.5, 1.0, 2.0**119])
    assert torch.equal(Q.ue8m0_to_scales(Q.scales_to_ue8m0(s)), s)
    v = torch.tensor([0.3, 0.5, 0.75, 1.0, 3e-7])
    p = Q.pow2_ceil(v)
    assert torch.equal(p, torch.tensor([0.5, 0.5, 1.0, 1.0, 2.0**-21]))


def test_fake_quant_is_straight_through():
    torch.manual_seed(0)
    x = torch.randn(5, 200, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(5, 200, dtype=torch.bfloat16)
    for f in (Q.fake_quant_rows, Q.fake_quant_blocks):
        x.grad = None
        y = f(x)
        assert y.dtype == torch.bfloat16 and not torch.equal(y, x)
        y.backward(g)
        assert torch.equal(x.grad, g)


@pytest.mark.parametrize("pow2", [False, True])
def test_requantizing_dispatched_rows_changes_no_value(pow2):
    """Rows dequantized on arrival and quantized again with the same 1 x 128 blocks (the
    blockwise experts' input quantization) keep their values: no second rounding between FP8
    dispatch and the blockwise FP8 GEMM. (With pow2 scales a block whose largest e4m3 value
    rounded down to 224 comes back with half the scale and twice the codes: same values.)"""
    torch.manual_seed(1)
    x = torch.randn(16, 300) * torch.randn(16, 1).exp() * torch.randn(1, 300).exp()
    once = Q.dequantize_blocks(*Q.quantize_blocks(x, 128, pow2), 128)
    twice = Q.dequantize_blocks(*Q.quantize_blocks(once, 128, pow2), 128)
    assert torch.equal(twice, once) and not torch.equal(once, x)
