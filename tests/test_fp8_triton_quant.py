"""The rowwise e4m3 quantizer in one Triton launch (moe/fp8/triton_quant.py, issue 61), run in
Triton's interpreter: the eager quantizer's codes and scales bit for bit (a NaN's sign aside),
float64-checked rounding, and the special values of issue 49 (Inf / NaN rows non-finite, zero
rows zero, float16's largest value exact, tiny gradients at full precision)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from moe.fp8 import quant as Q  # noqa: E402
from moe.fp8.triton_quant import fake_quant_groups_triton  # noqa: E402
from moe.fp8.triton_quant import quantize_rows_triton as _rows_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, else interpreted


def quantize_rows_triton(x, pow2, floor):
    """The kernel on DEV; results back on the CPU (the eager references run there)."""
    q, s = _rows_triton(x.to(DEV), pow2, floor)
    return q.cpu(), s.cpu()


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _same(a, b) -> bool:
    a, b = a.contiguous(), b.contiguous()
    both_nan = a.float().isnan() & b.float().isnan()
    return bool(((a.view(torch.uint8) == b.view(torch.uint8)) | both_nan).all())


def _rows(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-30, 30, 13).unsqueeze(1)
    x = (torch.randn(13, 150, generator=g) * mags).clamp(-1e38, 1e38).to(dtype)
    x[2], x[3, 5], x[4, 9], x[5, 0] = 0, float("inf"), float("nan"), -float("inf")
    x[6], x[7, :3], x[8] = torch.finfo(dtype).max, -torch.finfo(dtype).max, -0.0
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("floor", [Q.AMAX_FLOOR, 1e-4])
def test_same_codes_and_scales_as_the_eager_quantizer(dtype, pow2, floor):
    x = _rows(dtype)
    q, s = quantize_rows_triton(x, pow2, floor)
    q_ref, s_ref = Q.quantize_along(x, -1, pow2, floor)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (13, 1)
    assert _same(q, q_ref)
    assert torch.equal(s.isnan(), s_ref.isnan()) and torch.equal(s.nan_to_num(), s_ref.nan_to_num())


@pytest.mark.parametrize("pow2", [False, True])
def test_rounding_against_float64(pow2):
    """Each finite row dequantizes within half an e4m3 step (2^-4 relative) of x in float64,
    and an odd width (K = 150, not a block multiple) and strided rows are read right."""
    x = torch.randn(6, 300, dtype=torch.float64)
    q, s = _rows_triton(x.float().to(DEV)[:, :150], pow2, Q.AMAX_FLOOR)  # row stride 300
    q, s, x = q.cpu(), s.cpu(), x[:, :150]
    deq = q.double() * s.double()
    err = (deq - x).abs()
    step = 2.0 ** (torch.floor(torch.log2((x / s.double()).abs().clamp_min(2**-6))) - 3)
    assert (err <= step * s.double() / 2 + 1e-300).all()


def test_special_values():
    x = _rows(torch.float16)
    q, s = quantize_rows_triton(x, True, Q.AMAX_FLOOR)
    y = Q.dequantize(q, s, torch.float16)
    assert y[3:6].isnan().any(dim=1).all() and not s[3:6].isfinite().any()  # Inf / NaN rows
    assert (y[2] == 0).all() and (y[8] == 0).all() and s[2].isfinite().all()  # zero rows
    assert y[6, 0] == torch.finfo(torch.float16).max  # float16's largest, exact
    tiny = torch.randn(4, 64) * 1e-30  # gradients scaled far down keep e4m3's precision
    qt, st = quantize_rows_triton(tiny, True, Q.AMAX_FLOOR)
    t64 = tiny.double()
    rel = ((qt.double() * st.double() - t64).norm() / t64.norm()).item()
    assert rel < 2**-4


def test_no_rows():
    q, s = quantize_rows_triton(torch.empty(0, 32), False, Q.AMAX_FLOOR)
    assert q.shape == (0, 32) and s.shape == (0, 1)


@pytest.mark.parametrize("dim", [1, 2])
def test_weight_forms_as_rows(dim):
    """The weights' forms on CUDA: per output column (dim 1) as rows of the transpose, per
    (e, k) row (dim 2) as rows of w: the eager quantizer's codes and scales."""
    w = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(2)).bfloat16()
    q_ref, s_ref = Q.quantize_along(w, dim, True, Q.AMAX_FLOOR)
    rows = w.transpose(1, 2).contiguous() if dim == 1 else w
    q, s = quantize_rows_triton(rows, True, Q.AMAX_FLOOR)
    if dim == 1:
        q, s = q.transpose(1, 2), s.transpose(1, 2)
    assert _same(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_columns_as_the_eager_quantizer(dtype):
    """The weight gradient's operands (each column scaled within each expert's rows), in one
    launch: the eager dequantize_groups(quantize_groups(...)) bit for bit, in float32 and in
    bf16; an empty expert, tail rows (zero), Inf / NaN, a group of tiny values, an uneven
    width and a group longer than the kernel's row block."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(90, 40, generator=g) * 3).to(dtype)
    x[5, 3], x[40, 1] = float("inf"), float("nan")
    x[20:30] *= 1e-20
    offs = torch.tensor([10, 10, 33, 81], dtype=torch.int32)
    ref = Q.dequantize_groups(*Q.quantize_groups(x, offs, True, Q.AMAX_FLOOR), offs)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = fake_quant_groups_triton(x.to(DEV), offs.to(DEV), True, Q.AMAX_FLOOR, out_dtype)
        out = out.cpu()
        want = ref.to(out_dtype)
        assert bool(((out == want) | (out.isnan() & want.isnan())).all())
    assert (out[81:] == 0).all()
