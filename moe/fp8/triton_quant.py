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

E4M3_MAX = 448.0
F32_MAX = 3.4028234663852886e38


@triton.jit
def _nan_max(a, b):
    return tl.where((a != a) | (a > b), a, b)


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
    scale = tl.where(amax < floor, floor, amax) / E4M3_MAX  # NaN stays NaN
    if POW2:  # the next power of two; powers of two, Inf and NaN as they are
        bits = scale.to(tl.int32, bitcast=True)
        expo = (bits >> 23) & 0xFF
        up = ((expo + 1) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(((bits & 0x7FFFFF) == 0) | (expo == 255), scale, up)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    # the cap: the largest e4m3 value c with c * scale finite (448 but for scales > 2^119)
    lim = F32_MAX / scale
    lim = tl.where(lim > E4M3_MAX, E4M3_MAX, lim)
    lim_e = ((lim.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.exp2((tl.maximum(lim_e, -6) - 3).to(tl.float32))
    cap = tl.floor(lim / step) * step  # rounded down onto e4m3's grid (0 for an Inf scale)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)
        v = x.to(tl.float32) / scale[:, None]
        c = cap[:, None]
        v = tl.where(v > c, c, tl.where(v < -c, -c, v))  # NaN stays NaN
        bits = v.to(tl.int32, bitcast=True)
        a = tl.abs(v)
        a_e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        magic = tl.exp2((tl.maximum(a_e, -6) - 3 + 23).to(tl.float32)) * 1.5
        r = (a + magic) - magic  # |v| rounded to nearest even on e4m3's grid: 2^(e - 3) steps
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
