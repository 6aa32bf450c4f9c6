"""The blockwise recipe's e4m3 grouped GEMM (moe/fp8/triton_block_gemm.py, issue 61), run in
Triton's interpreter on CPU: the forward and the dgrad (w^T read as a view) against a float64
GEMM of the dequantized operands (empty experts, partial row tiles, tail rows zero), and the
FP8 expert MLP through the fused blockwise path against the eager chain."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from moe.fp8 import quant as Q  # noqa: E402
from moe.fp8.triton_block_gemm import block_mm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(a_MK, as_MB, b_EKN, bs_EKN, offsets):
    """float64 y[rows of e] = dequantized a @ dequantized b[e]; tail rows zero; and the same
    GEMM of the magnitudes (the float32 rounding bound)."""
    K, N = b_EKN.shape[1:]
    a = Q.dequantize(a_MK, Q.expand_blocks(as_MB, K), torch.float64)
    b = Q.dequantize(b_EKN, Q.expand_weight_blocks(bs_EKN, K, N), torch.float64)
    y, mag = a.new_zeros(a.shape[0], N), a.new_zeros(a.shape[0], N)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        y[start:end] = a[start:end] @ b[e]
        mag[start:end] = a[start:end].abs() @ b[e].abs()
        start = end
    return y, mag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_dgrad_against_float64(dtype):
    """y = x @ w (w as stored, N contiguous, and as a K-contiguous copy) and dx = dy @ w^T (the
    same codes and scales read transposed), several experts, one empty, rows not multiples of
    the row tile, 9 tail rows; e4m3 operands spanning many binades."""
    g = torch.Generator().manual_seed(0)
    E, K, N, M = 4, 256, 384, 61
    offsets = torch.tensor([13, 13, 40, 52], dtype=torch.int32)
    w = torch.randn(E, K, N, generator=g) * torch.logspace(-3, 3, N)
    q_w, s_w = Q.quantize_weight_blocks(w, 128, True, Q.AMAX_FLOOR)
    for a_width, b, bs in (
        (K, q_w, s_w),  # forward, N-major b
        (K, q_w.transpose(1, 2).contiguous().transpose(1, 2), s_w),  # forward, K-major b
        (N, q_w.transpose(1, 2), s_w.transpose(1, 2)),  # dgrad: w^T, a view
    ):
        x = torch.randn(M, a_width, generator=g) * torch.logspace(2, -2, M)[:, None]
        q_x, s_x = Q.quantize_blocks(x, 128, True, Q.AMAX_FLOOR)
        got = block_mm(q_x.to(DEV), s_x.to(DEV), b.to(DEV), bs.to(DEV), offsets.to(DEV), dtype)
        want, mag = _reference(q_x, s_x, b, bs, offsets)
        assert got.dtype == dtype and got.shape == want.shape
        got, bound = got.cpu().double(), mag * 2**-18  # float32 sums of K products
        if dtype == torch.bfloat16:  # and one rounding to nearest in bf16
            bound = bound + want.abs() * 2**-8
        assert (got - want).abs().le(bound).all(), (got - want).abs().max()
        assert (got[52:] == 0).all() and got[:52].abs().sum() > 0


def test_no_rows_and_bad_operands():
    q = torch.zeros(0, 128, dtype=torch.float8_e4m3fn)
    w = torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn)
    s_w = torch.ones(2, 1, 1)
    offsets = torch.zeros(2, dtype=torch.int32)
    got = block_mm(q.to(DEV), torch.ones(0, 1, device=DEV), w.to(DEV), s_w.to(DEV),
                   offsets.to(DEV), torch.float32)  # fmt: skip
    assert got.shape == (0, 128)
    w96 = torch.zeros(2, 96, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiples of 128"):
        block_mm(q[:0, :96], torch.ones(0, 1), w96, s_w, offsets, torch.float32)
    with pytest.raises(ValueError, match="scales"):
        block_mm(torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.ones(4, 2), w, s_w,
                 offsets, torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="float32 scales"):  # (e.g. ue8m0 bytes)
        block_mm(q, torch.ones(0, 1, dtype=torch.uint8), w, s_w, offsets, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_grouped_mm_fused_blockwise_as_the_eager_chain(dtype, monkeypatch):
    """moe.fp8 fp8_grouped_mm (blockwise) with its forward and dgrad on the e4m3 GEMM (the CUDA
    path, interpreted here) against the eager chain: output and both gradients, several
    experts, one empty, 7 tail rows; the same products summed in another order."""
    from moe.fp8 import blockwise
    from moe.fp8.grouped_mm import fp8_grouped_mm

    g = torch.Generator().manual_seed(5)
    E, K, N, M = 3, 256, 128, 50
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(E, K, N, generator=g) * 0.1).to(dtype)
    offsets = torch.tensor([20, 20, 43], dtype=torch.int32)

    def run(fused):
        monkeypatch.setattr(blockwise, "fused", lambda t, w, pow2: fused and pow2)
        leaves = [t.clone().to(DEV).requires_grad_() for t in (x, w)]
        y = fp8_grouped_mm(*leaves, offsets.to(DEV), recipe="blockwise")
        y.float().square().sum().backward()
        return [t.detach().float().cpu() for t in (y, *(leaf.grad for leaf in leaves))]

    tol = 2**-7 if dtype == torch.bfloat16 else 2**-18
    fused = run(True)
    for got, want in zip(fused, run(False)):
        assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())
    assert (fused[0][43:] == 0).all() and (fused[1][43:] == 0).all()


def test_special_values_reach_the_output():
    """A block holding Inf (scale Inf, its codes NaN or 0) or NaN makes the rows it feeds NaN,
    as the float64 GEMM of the dequantized operands does; the other rows stay finite."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 256, generator=g)
    x[2, 5], x[6, 200] = float("inf"), float("nan")
    q_x, s_x = Q.quantize_blocks(x, 128, True, Q.AMAX_FLOOR)
    q_w, s_w = Q.quantize_weight_blocks(torch.randn(2, 256, 128, generator=g), 128, True, 2**-20)
    offsets = torch.tensor([4, 9], dtype=torch.int32)
    b = q_w.transpose(1, 2).contiguous().transpose(1, 2)  # K-contiguous, as the forward reads
    got = block_mm(q_x.to(DEV), s_x.to(DEV), b.to(DEV), s_w.to(DEV), offsets.to(DEV),
                   torch.float32).cpu()  # fmt: skip
    want, _ = _reference(q_x, s_x, q_w, s_w, offsets)
    bad = torch.zeros(9, dtype=torch.bool)
    bad[[2, 6]] = True
    assert got[bad].isnan().all() and want[bad].isnan().all()
    assert got[~bad].isfinite().all() and torch.allclose(got[~bad].double(), want[~bad], rtol=1e-5)


def test_two_products_in_one_sum():
    """The second operands (the SwiGLU MLP's dh @ w1^T + dg @ w3^T, w^T read as views) add
    into the same float32 sum: the float64 sum of both products."""
    g = torch.Generator().manual_seed(7)
    E, K, N, M = 2, 128, 256, 37
    offsets = torch.tensor([0, 30], dtype=torch.int32)
    ops, want, mag = [], 0, 0
    for _ in range(2):
        q_w, s_w = Q.quantize_weight_blocks(torch.randn(E, K, N, generator=g), 128, True, 2**-20)
        q_d, s_d = Q.quantize_blocks(torch.randn(M, N, generator=g), 128, True, 2**-20)
        b, b_s = q_w.transpose(1, 2), s_w.transpose(1, 2)
        ops += [t.to(DEV) for t in (q_d, s_d, b, b_s)]
        y, m = _reference(q_d, s_d, b, b_s, offsets)
        want, mag = want + y, mag + m
    got = block_mm(*ops[:4], offsets.to(DEV), torch.float32, *ops[4:]).cpu().double()
    assert (got - want).abs().le(mag * 2**-18).all() and (got[30:] == 0).all()
    with pytest.raises(ValueError, match="second operands"):
        block_mm(*ops[:4], offsets.to(DEV), torch.float32, *ops[4:6], ops[6].contiguous(), ops[7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_w", [False, True])
def test_swiglu_epilogue_as_the_chain(dtype, row_w):
    """moe::fp8_block_swiglu_mm: h and g as two fp8_block_mm launches, and the codes and
    scales of silu(h) * g [* w_R1] as quantize_blocks makes them from the activation in x's
    dtype, bit for bit (on CPU the silu of ATen's CUDA kernel, which the interpreted kernel
    computes: torch's CPU silu rounds differently); an empty expert, tail rows, a row of x
    that is NaN, one whose h overflows to Inf (non-finite blocks: NaN after dequantizing)."""
    from moe.fp8.triton_swiglu_mm import swiglu_mm

    g = torch.Generator().manual_seed(5)
    E, K, N, M = 4, 256, 256, 61
    offsets = torch.tensor([13, 13, 40, 52], dtype=torch.int32)
    w1, w3 = (torch.randn(E, K, N, generator=g) * torch.logspace(-2, 1, N) for _ in range(2))
    (q1, s1), (q3, s3) = (Q.quantize_weight_blocks(w, 128, True, Q.AMAX_FLOOR) for w in (w1, w3))
    x = torch.randn(M, K, generator=g) * torch.logspace(1, -2, M)[:, None]
    x[20], x[30, :128] = float("nan"), 3e38  # row 30: h's first columns overflow
    q_x, s_x = Q.quantize_blocks(x, 128, True, Q.AMAX_FLOOR)
    w_R1 = torch.rand(M, 1, generator=g).to(dtype) if row_w else None
    dev = [t.to(DEV) for t in (q_x, s_x, q1, s1, q3, s3, offsets)]
    h, gt, q, s = swiglu_mm(*dev, dtype, None if w_R1 is None else w_R1.to(DEV), True,
                            Q.AMAX_FLOOR)  # fmt: skip
    h_ref = block_mm(*dev[:4], dev[6], dtype)
    g_ref = block_mm(*dev[:2], *dev[4:], dtype)
    if DEV == "cuda":
        silu = torch.nn.functional.silu(h_ref)
    else:  # ATen's CUDA silu: float32 h / (1 + expf(-h)), expf correctly rounded here
        h32 = h_ref.float()
        silu = (h32 / (torch.exp(-h32.double()).float() + 1)).to(dtype)
    a = silu * g_ref
    a = a if w_R1 is None else a * w_R1.to(DEV)
    q_ref, s_ref = Q.quantize_blocks(a, 128, True, Q.AMAX_FLOOR)
    for got, want in ((h, h_ref), (gt, g_ref)):  # (a NaN's sign and payload: any)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])
    assert h[30, :128].isinf().any() and h[20].isnan().all() and (h[52:] == 0).all()
    finite = s_ref.isfinite()
    assert torch.equal(s.isfinite(), finite) and torch.equal(s[finite], s_ref[finite])
    assert not finite.all() and (s_ref[52:] == s_ref[60, 0]).all()  # tail rows: the floor's
    live = finite.repeat_interleave(128, 1)
    assert torch.equal(q.view(torch.uint8)[live], q_ref.view(torch.uint8)[live])
    v = Q.dequantize_blocks(q.cpu(), s.cpu(), 128)
    assert v[~live.cpu()].isnan().all()


def test_swiglu_epilogue_no_rows_bad_operands_and_opcheck():
    """No rows: empty outputs; one ValueError for a dtype it does not take and for row weights
    of another shape or dtype; the schema and fake registration agree with the op."""
    from moe.fp8.triton_swiglu_mm import swiglu_mm

    g = torch.Generator().manual_seed(6)
    w = torch.randn(2, 128, 128, generator=g)
    q_w, s_w = (t.to(DEV) for t in Q.quantize_weight_blocks(w, 128, True, Q.AMAX_FLOOR))
    q_x, s_x = (t.to(DEV) for t in Q.quantize_blocks(torch.randn(7, 128, generator=g), 128))
    offsets = torch.tensor([3, 5], dtype=torch.int32, device=DEV)
    b = (q_w, s_w, q_w, s_w, offsets)
    h, _, q, s = swiglu_mm(q_x[:0], s_x[:0], *b, torch.bfloat16, None, True, Q.AMAX_FLOOR)
    assert h.shape == q.shape == (0, 128) and s.shape == (0, 1)
    with pytest.raises(ValueError, match="out_dtype"):
        swiglu_mm(q_x, s_x, *b, torch.float16, None, True, Q.AMAX_FLOOR)
    with pytest.raises(ValueError, match="w1's shapes"):
        swiglu_mm(q_x, s_x, q_w, s_w, q_w[:1], s_w[:1], offsets, torch.bfloat16, None, True, 1.0)
    with pytest.raises(ValueError, match="row weights"):
        swiglu_mm(q_x, s_x, *b, torch.bfloat16, torch.ones(7, 1, device=DEV), True, 1e-12)
    rw = torch.rand(7, 1, generator=g).bfloat16().to(DEV)
    args = (q_x.view(torch.uint8), s_x, q_w.view(torch.uint8), s_w, q_w.view(torch.uint8), s_w,
            offsets, torch.bfloat16, rw, True, Q.AMAX_FLOOR)  # fmt: skip
    torch.library.opcheck(torch.ops.moe.fp8_block_swiglu_mm, args,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
