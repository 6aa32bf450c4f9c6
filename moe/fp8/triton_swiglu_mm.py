"""The blockwise FP8 expert MLP's up and gate GEMMs in one launch with the SwiGLU and the down
GEMM's 1 x 128 quantization in the epilogue (issue 61), as the custom op
`moe::fp8_block_swiglu_mm`:

    h = x @ w1, g = x @ w3            (moe::fp8_block_mm's products, sharing x's tiles)
    a = silu(h) * g [* w_R1]          (in x's dtype, rounded where torch rounds)
    q_a, s_a = a's e4m3 codes and one scale per 1 x 128 block (BLOCK_N = 128: a tile's row)

h and g are written in x's dtype (the backward keeps them). The chain it replaces (two
fp8_block_mm launches, silu, two multiplies, moe.fp8.quant.quantize_blocks) gives the same
bits: h and g rounded to x's dtype, silu as ATen's CUDA kernel computes it in float32
(x / (1 + exp(-x)), expf and an IEEE division: libdevice's exp, div_rn) and rounded, each
product in float32 rounded to x's dtype, then the row quantizer's scale, cap and codes
(moe/fp8/triton_quant.py's helpers). Under Triton's interpreter (whose float32 -> bf16 cast
truncates and whose float32 exp is numpy's) bf16 roundings are done to nearest even on the
bits and exp is taken in float64, then rounded (INTERP): the GPU's formula, not torch's CPU
kernel's. bf16 or float32 x only; other activations and a bias b1 keep the chain.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moe.fp8.triton_block_gemm import BLOCK, _k_blocks, check, tile_rows
from moe.fp8.triton_quant import _cap, _e4m3_code, _nan_max, _scale, round_bf16
from moe.kernels.triton.common import autotune_prune, e_pow2, interpreting, m_bucket
from moe.kernels.triton.schedule import expert_tile, grouped_tile, max_row_tiles


def _configs() -> list[triton.Config]:
    """(BLOCK_M, num_warps, num_stages); BLOCK_N = BLOCK_K = 128 (one tile row: one scale)."""
    table = [(128, 8, 3), (64, 4, 4)] if not interpreting() else [(16, 4, 1)]
    return [
        triton.Config(dict(BLOCK_M=m, BLOCK_N=BLOCK, BLOCK_K=BLOCK, GROUP_M=8), num_warps=w,
                      num_stages=s)
        for m, w, s in table
    ]  # fmt: skip


@triton.jit
def _to_dtype(v, BF16: tl.constexpr):
    """v (float32) rounded to x's dtype, as float32: bf16 to nearest even on the bits (the
    GPU's cast; the interpreter's truncates), NaN kept; float32 as it is."""
    if BF16:
        v = round_bf16(v)
    return v


@triton.jit
def _silu(h, INTERP: tl.constexpr):
    """ATen's CUDA silu in float32: h / (1 + exp(-h)) (expf, IEEE division)."""
    if INTERP:  # numpy's float32 exp is not expf: float64, rounded
        e = tl.exp((-h).to(tl.float64)).to(tl.float32)
    else:
        e = libdevice.exp(-h)
    return tl.math.div_rn(h, e + 1.0)


@triton.autotune(
    configs=_configs(),
    key=["N", "K", "E", "M_BUCKET", "ROW_W", "BF16"],
    prune_configs_by={"early_config_prune": autotune_prune()},
)
@triton.jit
def _swiglu_mm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, b3_ptr, bs3_ptr, h_ptr, g_ptr, q_ptr, qs_ptr, w_ptr,
    offsets_ptr, M, N, K, E, M_BUCKET,
    stride_am, stride_asm, stride_ask, stride_be, stride_bk, stride_bn,
    stride_se, stride_sk, stride_sn, stride_w, floor,
    E_POW2: tl.constexpr, ROW_W: tl.constexpr, BF16: tl.constexpr, POW2: tl.constexpr,
    INTERP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """One output tile of h and g (virtual row tile x 128 columns) and its a codes and scales;
    w1's and w3's operands have the same shapes and strides (moe::fp8_block_mm's)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, E, BLOCK_M, BLOCK_N, GROUP_M)

    seg, row0, seg_end = expert_tile(pid_m, offsets_ptr, E, M, BLOCK_M, E_POW2)
    if seg <= E:  # else: a virtual tile past the real ones
        rows, row_ok, live, e64, num_k = tile_rows(seg, row0, seg_end, K, E, BLOCK_M, BLOCK_K)
        h = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        h = _k_blocks(h, a_ptr, as_ptr, b_ptr, bs_ptr, rows, live, e64, pid_n, num_k,
                      stride_am, stride_asm, stride_ask, stride_be, stride_bk, stride_bn,
                      stride_se, stride_sk, stride_sn, INTERP, BLOCK_N, BLOCK_K)  # fmt: skip
        g = _k_blocks(g, a_ptr, as_ptr, b3_ptr, bs3_ptr, rows, live, e64, pid_n, num_k,
                      stride_am, stride_asm, stride_ask, stride_be, stride_bk, stride_bn,
                      stride_se, stride_sk, stride_sn, INTERP, BLOCK_N, BLOCK_K)  # fmt: skip
        h = _to_dtype(h, BF16)
        g = _to_dtype(g, BF16)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        at = rows[:, None] * N + offs_n[None, :]
        tl.store(h_ptr + at, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(g_ptr + at, g.to(g_ptr.dtype.element_ty), mask=row_ok[:, None])
        a = _to_dtype(_to_dtype(_silu(h, INTERP), BF16) * g, BF16)
        if ROW_W:  # a * w_R1, in x's dtype
            w = tl.load(w_ptr + rows * stride_w, mask=row_ok, other=0.0).to(tl.float32)
            a = _to_dtype(a * w[:, None], BF16)
        # moe/fp8/triton_quant.py's row quantizer over this 1 x 128 block of each row
        amax = _nan_max(tl.zeros([BLOCK_M], dtype=tl.float32), tl.reduce(tl.abs(a), 1, _nan_max))
        scale = _scale(amax, floor, POW2)
        tl.store(qs_ptr + rows * (N // BLOCK_N) + pid_n, scale, mask=row_ok)  # (N % 128 == 0)
        cap = _cap(scale)
        v = a / scale[:, None]
        c = cap[:, None]
        v = tl.where(v > c, c, tl.where(v < -c, -c, v))  # NaN stays NaN
        q = _e4m3_code(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        tl.store(q_ptr + at, q, mask=row_ok[:, None])


@torch.library.custom_op("moe::fp8_block_swiglu_mm", mutates_args=())
def swiglu_mm(
    q_MK: torch.Tensor,
    s_MB: torch.Tensor,
    q1_EKN: torch.Tensor,
    s1_EKN: torch.Tensor,
    q3_EKN: torch.Tensor,
    s3_EKN: torch.Tensor,
    offsets_E: torch.Tensor,
    out_dtype: torch.dtype,
    w_M1: torch.Tensor | None,
    pow2: bool,
    floor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, g in out_dtype, a's e4m3 codes [M, N], its scales [M, N / 128] float32) with
    a = silu(h) * g [* w_M1] (see the module docstring); tail rows: h, g and codes zero. x's
    codes and scales and each weight's as moe::fp8_block_mm takes them; w_M1 in out_dtype."""
    check(q_MK, s_MB, q1_EKN, s1_EKN, offsets_E)
    if [(t.shape, t.stride()) for t in (q3_EKN, s3_EKN)] != [
        (t.shape, t.stride()) for t in (q1_EKN, s1_EKN)
    ]:
        raise ValueError("fp8_block_swiglu_mm: w3's codes and scales need w1's shapes, strides")
    check(q_MK, s_MB, q3_EKN, s3_EKN, offsets_E)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_block_swiglu_mm: out_dtype bf16 or float32, got {out_dtype}")
    (M, K), (E, _, N) = q_MK.shape, q1_EKN.shape
    if w_M1 is not None and (w_M1.shape != (M, 1) or w_M1.dtype != out_dtype):
        raise ValueError(
            f"fp8_block_swiglu_mm: row weights [{M}, 1] in {out_dtype}, got "
            f"{tuple(w_M1.shape)} {w_M1.dtype}"
        )
    dev = q_MK.device
    h, g = (torch.empty((M, N), dtype=out_dtype, device=dev) for _ in range(2))
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty((M, N // BLOCK), dtype=torch.float32, device=dev)
    if M == 0:
        return h, g, q, s
    b1, b3 = q1_EKN.view(torch.float8_e4m3fn), q3_EKN.view(torch.float8_e4m3fn)

    def grid(meta):
        return (max_row_tiles(M, E, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _swiglu_mm_kernel[grid](
        q_MK.view(torch.float8_e4m3fn), s_MB, b1, s1_EKN, b3, s3_EKN, h, g, q, s,
        w_M1 if w_M1 is not None else s, offsets_E.to(torch.int32), M, N, K, E, m_bucket(M),
        q_MK.stride(0), *s_MB.stride(), *b1.stride(), *s1_EKN.stride(),
        w_M1.stride(0) if w_M1 is not None else 0, float(floor),
        E_POW2=e_pow2(E), ROW_W=w_M1 is not None, BF16=out_dtype == torch.bfloat16, POW2=pow2,
        INTERP=interpreting(),
    )  # fmt: skip
    return h, g, q, s


@swiglu_mm.register_fake
def _(q_MK, s_MB, q1_EKN, s1_EKN, q3_EKN, s3_EKN, offsets_E, out_dtype, w_M1, pow2, floor):
    M, N = q_MK.shape[0], q1_EKN.shape[2]
    h, g = (q_MK.new_empty(M, N, dtype=out_dtype) for _ in range(2))
    q = q_MK.new_empty(M, N, dtype=torch.float8_e4m3fn)
    return h, g, q, q_MK.new_empty(M, N // BLOCK, dtype=torch.float32)
