"""Grouped GEMMs of dequantized e4m3 operands (the emulated recipes' GEMMs, float32 in and out).

On CUDA with power-of-two scales the operands are exact in bf16 (e4m3's 3 mantissa bits times
2^k; only values below bf16's smallest subnormal, 2^-133, in blocks scaled at the floor, are
not), so they run as the bf16 grouped GEMM (torch._grouped_mm: tensor cores, float32
accumulation). In float32 on CUDA moe.kernels.torch_grouped_mm would fall back to per-expert
matmuls after a host read of the offsets (bench/results/2026-12-07-budget.md: 9 syncs and up to
1,249 GEMMs per blockwise step). Elsewhere: the float32 grouped GEMM, as before.
"""

from torch import Tensor

from moe.kernels.torch_grouped_mm import mm_groups, wgrad_groups


def mm_exact(a_MK: Tensor, b_EKN: Tensor, offsets_E: Tensor, pow2: bool) -> Tensor:
    """y[rows of e] = a[rows of e] @ b[e], float32; tail rows zero."""
    if pow2 and a_MK.is_cuda:
        return mm_groups(a_MK.bfloat16(), b_EKN.bfloat16(), offsets_E).float()
    return mm_groups(a_MK, b_EKN, offsets_E)


def wgrad_exact(a_MK: Tensor, d_MN: Tensor, offsets_E: Tensor, pow2: bool) -> Tensor:
    """dw[e] = a[rows of e]^T @ d[rows of e], float32; empty groups zero."""
    if pow2 and a_MK.is_cuda:
        return wgrad_groups(a_MK.bfloat16(), d_MN.bfloat16(), offsets_E).float()
    return wgrad_groups(a_MK, d_MN, offsets_E)
