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


def _groups_input(dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(77, 37, generator=g) * 3).to(dtype)  # K odd, M not a block multiple
    x[5, 3], x[40, 1], x[60, 0] = float("inf"), float("nan"), -float("inf")
    x[20:30] *= 1e-25  # a group of tiny values (gradients far down)
    x[31:33] = 0
    offs = torch.tensor([10, 10, 33, 70], dtype=torch.int32)  # an empty expert; tail 70..77
    return x, offs


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_launch_writes_both_orientations(dtype):
    """Row-wise codes and scales and the transposed copy (codes scaled per column within each
    expert's rows, [K, M]) with its [E, K] scales, from ONE launch: the eager quantizers'
    codes and scales bit for bit (tail rows: zero codes), special values included."""
    from moe.fp8.triton_quant import quantize

    x, offs = _groups_input(dtype)
    q, s, qc, sc = quantize(x.to(DEV), True, Q.AMAX_FLOOR, groups=offs.to(DEV))
    q_ref, s_ref = Q.quantize_along(x, -1, True, Q.AMAX_FLOOR)
    assert _same(q.cpu(), q_ref) and torch.equal(s.cpu().nan_to_num(), s_ref.nan_to_num())
    qg_ref, sg_ref = Q.quantize_groups(x, offs, True, Q.AMAX_FLOOR)
    assert qc.shape == (37, 77) and sc.shape == (4, 37)
    # a column of an expert holding Inf has scale Inf: its codes are +-0 (and NaN), the sign
    # of a zero differs from the eager clamp's; both dequantize to NaN (0 x Inf)
    unsigned_zero = lambda t: t.float().where(t.float() != 0, 0.0).to(t.dtype)
    assert _same(unsigned_zero(qc.cpu().t()), unsigned_zero(qg_ref))
    assert torch.equal(sc.cpu().nan_to_num(), sg_ref.nan_to_num())
    assert (qc.cpu()[:, 70:].float() == 0).all()


def test_transposed_copy_against_float64():
    """Each finite column of each expert dequantizes within half an e4m3 step of x (float64);
    the tiny group keeps that precision."""
    from moe.fp8.triton_quant import quantize

    x, offs = _groups_input(torch.float32, seed=6)
    x[5, 3] = x[40, 1] = x[60, 0] = 1.0
    _, _, qc, sc = quantize(x.to(DEV), False, Q.AMAX_FLOOR, rows=False, groups=offs.to(DEV))
    qc, sc = qc.cpu().t().double(), sc.cpu().double()
    group = Q.group_of_rows(offs, 77).long()
    s_M = torch.cat([sc, torch.ones(1, 37, dtype=torch.float64)])[group]
    x64 = x.double()
    live = (group < 4).unsqueeze(1)
    step = 2.0 ** (torch.floor(torch.log2((x64 / s_M).abs().clamp_min(2**-6))) - 3)
    err = (qc * s_M - x64).abs()
    assert ((err <= step * s_M / 2 + 1e-300) | ~live).all()


def test_weight_forms_in_one_launch():
    """Both rowwise weight forms from one launch over w [E, K, N]: dgrad per (e, k) row, and
    fprop per (e, n) column written transposed [E, N, K] (column-major as the scaled GEMM takes
    it): the eager forms' codes and scales."""
    from moe.fp8.triton_quant import quantize

    E, K, N = 3, 40, 24
    w = torch.randn(E, K, N, generator=torch.Generator().manual_seed(2)).bfloat16()
    ends = torch.arange(1, E + 1, dtype=torch.int32) * K
    q, s, qc, sc = quantize(w.to(DEV), True, Q.AMAX_FLOOR, groups=ends.to(DEV),
                            transposed=(K, K * (N - 1), (E, N, K)))  # fmt: skip
    qd_ref, sd_ref = Q.quantize_along(w, 2, True, Q.AMAX_FLOOR)
    qf_ref, sf_ref = Q.quantize_along(w, 1, True, Q.AMAX_FLOOR)
    assert _same(q.cpu(), qd_ref) and torch.equal(s.cpu().view(E, K, 1), sd_ref)
    assert _same(qc.cpu().transpose(1, 2), qf_ref) and torch.equal(sc.cpu().view(E, 1, N), sf_ref)


@pytest.mark.parametrize("save_fp8", [True, False])
def test_expert_mlp_backward_from_one_launch_operands(monkeypatch, save_fp8):
    """The FP8 expert MLP's backward with its operands from the one-launch quantization (the
    CUDA path, here interpreted on CPU): the eager chain's gradients (the same e4m3 values; the
    weight gradients from the e4m3 codes on the FP8 weight-gradient GEMM, float32 accumulation
    as the eager float32 GEMM; tests/test_fp8_wgrad_gemm.py checks them in float32)."""
    from moe.fp8 import FP8Config, fp8_expert_mlp, operands
    from moe.kernels.expert_rows import ExpertRows

    g = torch.Generator().manual_seed(3)
    T, D, F, E = 13, 24, 40, 3
    x = torch.randn(T, D, generator=g).bfloat16()
    ws = [torch.randn(E, *s, generator=g).bfloat16() * 0.3 for s in ((D, F), (F, D), (D, F))]
    ids = torch.randint(0, T, (21,), generator=g)
    offsets = torch.tensor([7, 7, 19], dtype=torch.int32)  # an empty expert, 2 tail rows
    cfg = FP8Config(experts=True, save_fp8_inputs=save_fp8)

    def grads(fused):
        monkeypatch.setattr(operands, "one_launch", lambda t, op: fused and op[1])
        leaves = [t.to(DEV, copy=True).requires_grad_() for t in (x, *ws)]  # (GPU: compiled)
        y = fp8_expert_mlp(leaves[0], offsets.to(DEV), *leaves[1:], activation="swiglu",
                           rows=ExpertRows(gather_ids_R=ids.to(DEV)), config=cfg)  # fmt: skip
        y.float().square().sum().backward()
        return [t.grad.float().cpu() for t in leaves]

    for got, want in zip(grads(True), grads(False)):
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("pow2", [False, True])
def test_one_by_128_blocks_as_rows(pow2):
    """quant.quantize_blocks on CUDA (D a multiple of the block): the row quantizer over the
    blocks as rows gives the eager 1 x block codes and scales; dequantize_blocks broadcasting
    the scales over full blocks gives the per-element expansion's values."""
    x = _rows(torch.bfloat16)[:, :128].repeat(1, 3)  # 3 blocks of 128 per row, specials kept
    q, s = quantize_rows_triton(x.reshape(-1, 128), pow2, Q.AMAX_FLOOR)
    q_ref, s_ref = Q.quantize_blocks(x, 128, pow2, Q.AMAX_FLOOR)
    assert _same(q.view(x.shape), q_ref)
    assert torch.equal(s.view(13, 3).nan_to_num(), s_ref.nan_to_num())
    for dtype in (torch.float32, torch.float16):
        got = Q.dequantize_blocks(q_ref, s_ref, 128, dtype)
        want = Q.dequantize(q_ref, Q.expand_blocks(s_ref, 384, 128), dtype)
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
