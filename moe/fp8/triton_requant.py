"""FP8 dispatch rows requantized into the expert GEMM's scaling in ONE Triton launch (issue 61):
the codes and 1 x block scales that arrived (moe/fp8/rows.py) are decoded, rounded to the rows'
dtype as the wire's decode writes them (float16: saturated at its largest finite value, as
quant.dequantize does), and quantized again per row of `width` elements (the row for rowwise,
1 x 128 for blockwise), rows read through a row index where the dispatchers' permutation was
recorded (moe/fp8/rows.py), where the eager chain copies the permuted rows, writes the
dequantized rows (2 bytes an element in bf16) and reads them back. Same codes and scales bit for bit as
quant.quantize_along / quantize_blocks of quant.dequantize_blocks' rows (the jit helpers are
moe/fp8/triton_quant.py's); the rounding to bf16 / float16 is done on float32 bits, so Triton's
interpreter gives the GPU's values.
"""

import torch
import triton
import triton.language as tl

from moe.fp8.triton_quant import _cap, _decode, _e4m3_code, _nan_max, _scale, round_bf16

ROWS_PER_PROGRAM = 4
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round_to(v, DTYPE: tl.constexpr):
    """float32 v rounded to nearest even on bf16's (DTYPE 1) or float16's (2, saturating at
    65504) grid, still float32; NaN stays NaN."""
    if DTYPE == 1:
        v = round_bf16(v)
    if DTYPE == 2:
        v = tl.where(v > 65504.0, 65504.0, tl.where(v < -65504.0, -65504.0, v))
        a = tl.abs(v)
        a_e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        magic = tl.exp2((tl.maximum(a_e, -14) - 10 + 23).to(tl.float32)) * 1.5
        r = (a + magic) - magic
        r = (r.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(
            tl.float32, bitcast=True
        )
        v = tl.where(v != v, v, r)
    return v


@triton.jit
def _values(q_ptr, s_ptr, ids_ptr, rows, cols, ok, row_ok, per_row, stride_s, D, stride_q,
            SB: tl.constexpr, DTYPE: tl.constexpr, GATHER: tl.constexpr):  # fmt: skip
    """Rows (of `width` elements, per_row of them in each wire row of D) as the wire decodes
    them: code x its block's scale, rounded to the rows' dtype, float32."""
    src = rows.to(tl.int64) // per_row
    if GATHER:  # the stored row this row reads
        src = tl.load(ids_ptr + src, mask=row_ok, other=0).to(tl.int64)
    col = (rows.to(tl.int64) % per_row)[:, None] * (D // per_row) + cols[None, :]
    code = tl.load(q_ptr + src[:, None] * stride_q + col, mask=ok, other=0)
    s = tl.load(s_ptr + src[:, None] * stride_s + col // SB, mask=ok, other=1.0)
    return _round_to(_decode(code) * s, DTYPE)


@triton.jit
def _requant_kernel(q_ptr, s_ptr, ids_ptr, out_q_ptr, out_s_ptr, M, W, per_row, stride_s, D,
                    stride_q, floor, SB: tl.constexpr, DTYPE: tl.constexpr, POW2: tl.constexpr,
                    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, W, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < W)
        x = _values(q_ptr, s_ptr, ids_ptr, rows, cols, ok, row_ok, per_row, stride_s, D, stride_q,
                    SB, DTYPE, GATHER)  # fmt: skip
        amax = _nan_max(amax, tl.reduce(tl.abs(x), 1, _nan_max))
    scale = _scale(amax, floor, POW2)
    tl.store(out_s_ptr + rows, scale, mask=row_ok)
    cap = _cap(scale)
    for k0 in range(0, W, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < W)
        x = _values(q_ptr, s_ptr, ids_ptr, rows, cols, ok, row_ok, per_row, stride_s, D, stride_q,
                    SB, DTYPE, GATHER)  # fmt: skip
        v = x / scale[:, None]
        c = cap[:, None]
        v = tl.where(v > c, c, tl.where(v < -c, -c, v))
        at = rows[:, None].to(tl.int64) * W + cols[None, :]
        tl.store(
            out_q_ptr + at, _e4m3_code(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True), mask=ok
        )


def requantize_triton(codes_SD, scales_SB, block: int, dtype, width: int, pow2: bool, floor,
                      rows_N=None):  # fmt: skip
    """(codes uint8 [N, D], scales [N, D / width]): the rows codes_SD x scales_SB (1 x block
    scales) decode to in dtype, read at rows_N (else all S rows), quantized per `width`
    elements (D or a divisor of D), one launch. codes and scales may be row-strided views (of
    the payload)."""
    D = codes_SD.shape[1]
    N = codes_SD.shape[0] if rows_N is None else rows_N.shape[0]
    per_row = D // width
    q = torch.empty((N, D), dtype=torch.float8_e4m3fn, device=codes_SD.device)
    s = torch.empty((N, per_row), dtype=torch.float32, device=codes_SD.device)
    M = N * per_row
    if M:
        codes = codes_SD if codes_SD.stride(1) == 1 else codes_SD.contiguous()
        scales = scales_SB if scales_SB.stride(1) == 1 else scales_SB.contiguous()
        _requant_kernel[(triton.cdiv(M, ROWS_PER_PROGRAM),)](
            codes, scales, rows_N if rows_N is not None else s, q, s, M, width, per_row,
            scales.stride(0), D, codes.stride(0), float(floor), SB=block, DTYPE=DTYPES[dtype],
            POW2=pow2, GATHER=rows_N is not None, BLOCK_M=ROWS_PER_PROGRAM,
            BLOCK_K=min(512, triton.next_power_of_2(max(width, 16))),
        )  # fmt: skip
    return q.view(torch.uint8), s
