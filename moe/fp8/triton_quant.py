"""Rowwise e4m3 quantization in ONE Triton launch (issue 61): per row of x [M, K], the amax,
the scale (moe.fp8.quant.scale_of: max(amax, floor) / 448, rounded up to a power of two with
pow2), the cap (quant.e4m3_cap) and the clamped, rounded e4m3 codes, where the eager chain of
quant.quantize_along(x, -1) issues ~20 kernels and float32 intermediates. Same codes and scales
bit for bit, special values included (a row holding Inf or NaN gets a non-finite scale and
dequantizes to NaN; the floor keeps zero rows zero and tiny rows at full precision).

The rounding to e4m3 is done in float32 (round to nearest even on e4m3's grid, by adding and
subtracting a power of two) and the code's bits are assembled as integers, so no float8 cast
is left to the compiler: Triton's interpreter truncates where the GPU rounds, and casts NaN to
a number; this way both give torch's codes (a NaN's sign aside, which no device fixes).

Used by moe.fp8.quant.quantize_along for 2-D CUDA tensors quantized along the last dim (the
activations' row-wise operands); `quantize_rows_triton` runs on CPU tensors under
TRITON_INTERPRET=1 (the tests).
"""

import torch
import triton
import triton.language as tl

# constexpr: a compiled kernel reads only constexpr globals (the interpreter reads any)
E4M3_MAX = tl.constexpr(448.0)
F32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _nan_max(a, b):
    return tl.where((a != a) | (a > b), a, b)


@triton.jit
def _e4m3_abs(v):
    """|v| (within e4m3's range) rounded to nearest even on e4m3's grid, in float32: steps of
    2^(e - 3) in binade e, 2^-9 below 2^-6; by adding and subtracting a power of two."""
    a = tl.abs(v)
    a_e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    magic = tl.exp2((tl.maximum(a_e, -6) - 3 + 23).to(tl.float32)) * 1.5
    return (a + magic) - magic


@triton.jit
def _cap(scale):
    """quant.e4m3_cap: the largest e4m3 value c with c * scale finite (448 unless scale is above
    2^119), rounded down onto e4m3's grid (0 for an Inf scale)."""
    lim = F32_MAX / scale
    lim = tl.where(lim > E4M3_MAX, E4M3_MAX, lim)
    lim_e = ((lim.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.exp2((tl.maximum(lim_e, -6) - 3).to(tl.float32))
    return tl.floor(lim / step) * step


@triton.jit
def _scale(amax, floor, POW2: tl.constexpr):
    """quant.scale_of: max(amax, floor) / 448, rounded up to a power of two with POW2 (powers
    of two, Inf and NaN as they are)."""
    scale = tl.where(amax < floor, floor, amax) / E4M3_MAX  # NaN stays NaN
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        expo = (bits >> 23) & 0xFF
        up = ((expo + 1) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(((bits & 0x7FFFFF) == 0) | (expo == 255), scale, up)
    return scale


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, floor,
    POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)
        amax = _nan_max(amax, tl.reduce(tl.abs(x.to(tl.float32)), 1, _nan_max))
    scale = _scale(amax, floor, POW2)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    cap = _cap(scale)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)
        v = x.to(tl.float32) / scale[:, None]
        c = cap[:, None]
        v = tl.where(v > c, c, tl.where(v < -c, -c, v))  # NaN stays NaN
        bits = v.to(tl.int32, bitcast=True)
        r = _e4m3_abs(v)
        rb = r.to(tl.int32, bitcast=True)
        r_e = ((rb >> 23) & 0xFF) - 127
        normal = ((r_e + 7) << 3) | ((rb >> 20) & 0x7)  # e4m3: bias 7, 3 mantissa bits
        sub = (r * 512.0).to(tl.int32)  # below 2^-6: multiples of 2^-9
        code = tl.where(r_e >= -6, normal, sub)
        code = tl.where(v != v, 0x7F, code) | ((bits >> 24) & 0x80)  # NaN; the sign
        q = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)  # the bits as they are
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=ok)


def quantize_rows_triton(x: torch.Tensor, pow2: bool, floor: float):
    """(q e4m3 like x, scales float32 [..., 1]) = quant.quantize_along(x, -1, pow2, floor), in
    one launch. x: rows along its last dim with unit stride, 2-D or contiguous; float32, bf16
    or fp16."""
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    BLOCK_M, BLOCK_K = 4, min(512, triton.next_power_of_2(max(K, 16)))
    _quant_rows_kernel[(triton.cdiv(M, BLOCK_M),)](
        x.detach(), q, s, M, K, x.stride(-2) if x.dim() > 1 else K, float(floor),
        POW2=pow2, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return q, s


@triton.jit
def _fake_quant_groups_kernel(
    x_ptr, out_ptr, offsets_ptr, M, K, E, stride_xm, floor,
    POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)  # expert e's rows, or (e == E) the tail rows past the last offset
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    start = tl.load(offsets_ptr + tl.maximum(e - 1, 0)) * (e > 0).to(tl.int32)
    end = tl.load(offsets_ptr + tl.minimum(e, E - 1))
    end = tl.where(e < E, end, M)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        ok = (rows < end)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)
        amax = _nan_max(amax, tl.reduce(tl.abs(x.to(tl.float32)), 0, _nan_max))
    scale = _scale(amax, floor, POW2)
    cap = _cap(scale)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        ok = (rows < end)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)
        v = x.to(tl.float32) / scale[None, :]
        c = cap[None, :]
        v = tl.where(v > c, c, tl.where(v < -c, -c, v))
        r = _e4m3_abs(v)
        r = (r.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(
            tl.float32, bitcast=True
        )
        y = tl.where(v != v, v, r) * scale[None, :]
        y = tl.where(e < E, y, 0.0)  # tail rows: zero
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=ok)  # fmt: skip


def fake_quant_groups_triton(
    x_MK: torch.Tensor, offsets_E: torch.Tensor, pow2: bool, floor: float, dtype: torch.dtype
) -> torch.Tensor:
    """dequantize_groups(*quant.quantize_groups(x, offsets, pow2, floor), offsets) in `dtype`,
    in one launch: each column scaled within each expert's rows (the weight gradient's
    operands), tail rows zero. With pow2 the values are exact in bf16 (e4m3 x 2^k)."""
    M, K = x_MK.shape
    out = torch.empty((M, K), dtype=dtype, device=x_MK.device)
    E = offsets_E.shape[0]
    if M == 0 or K == 0:
        return out
    if E == 0:
        return out.zero_()
    BLOCK_M, BLOCK_K = 32, min(128, triton.next_power_of_2(max(K, 16)))
    _fake_quant_groups_kernel[(E + 1, triton.cdiv(K, BLOCK_K))](
        x_MK.detach(), out, offsets_E, M, K, E, x_MK.stride(0), float(floor),
        POW2=pow2, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out
