"""The blockwise recipe's three GEMMs (DeepSeek-V3's scaling), emulated: e4m3 operands
dequantized to float32, then the grouped GEMM (moe/fp8/exact_mm.py: bf16 tensor cores on CUDA
with power-of-two scales, float32 elsewhere).

- forward  y = x @ w:     x one scale per 1 x 128 block along K, w one per 128 x 128 block;
- dgrad   dx = dy @ w^T:  dy one scale per 1 x 128 block along N, w the same 128 x 128 blocks;
- wgrad   dw = x^T @ dy:  x and dy one scale per column within each 128-row tile of one
  expert's rows (128 x 1 blocks along the tokens, restarting at every expert).
Partial blocks at the edges (widths not multiples of 128, experts with rows % 128 != 0).

On CUDA with power-of-two scales and widths that are multiples of 128 (`fused`) every operand
comes from one Triton launch that writes its codes' values in bf16 (exact): the weight's 128 x
128 blocks once per optimizer step (moe/fp8/triton_blocks.py; the dgrad reads the same values
transposed, a view), the 1 x 128 activation blocks as rows of 128, and the weight gradient's
per-tile columns (moe/fp8/operands.py); the GEMMs are the bf16 grouped GEMM. The same values
as the eager chain below, which every other device runs.
"""

import torch
from torch import Tensor

from moe.fp8.exact_mm import mm_exact, wgrad_exact
from moe.fp8.quant import (
    E4M3,
    dequantize,
    dequantize_blocks,
    expand_weight_blocks,
    quantize_blocks,
    quantize_row_tiles,
    quantize_weight_blocks,
)
from moe.fp8.weight_cache import cached_form
from moe.kernels.torch_grouped_mm import mm_groups
from moe.kernels.triton_kernel import triton_installed

BLOCK = 128


def weight(w_EKN: Tensor, pow2: bool, floor: float) -> Tensor:
    """w through its 128 x 128 blocks, float32: its e4m3 codes and block scales are made once
    per optimizer step (moe/fp8/weight_cache.py) and serve the forward and, transposed, the
    dgrad (square blocks: the transposed weight is a re-index of the same codes and scales)."""
    q, s = cached_form(  # 1 byte per element kept
        ("blocks", pow2, floor), w_EKN, lambda w: quantize_weight_blocks(w, BLOCK, pow2, floor)
    )
    return dequantize(q, expand_weight_blocks(s, *w_EKN.shape[1:], BLOCK))


def fused(t: Tensor, w_EKN: Tensor, pow2: bool) -> bool:
    """The one-launch operands apply (see the module docstring)."""
    K, N = w_EKN.shape[1:]
    return (
        t.is_cuda and pow2 and K % BLOCK == 0 and N % BLOCK == 0 and K > 0 and N > 0
        and triton_installed()
    )  # fmt: skip


def weight_values(w_EKN: Tensor, pow2: bool, floor: float) -> Tensor:
    """(fused) w's 128 x 128 block codes' values in bf16, made once per optimizer step with
    the codes and scales (one launch)."""
    from moe.fp8.triton_blocks import weight_blocks_triton

    make = lambda w: weight_blocks_triton(w, BLOCK, pow2, floor, torch.bfloat16)  # noqa: E731
    return cached_form(("blocks values", pow2, floor), w_EKN, make)[2]


def block_rows(x_MK: Tensor, pow2: bool, floor: float, codes: bool = True):
    """(fused) x's 1 x 128 blocks, one launch: (codes [M, K] or None without `codes`, scales
    [M, K / 128], values bf16)."""
    from moe.fp8.triton_quant import quantize

    M, K = x_MK.shape
    q, s, _, _, v = quantize(x_MK.contiguous().view(-1, BLOCK), pow2, floor,
                             row_values=torch.bfloat16, row_codes=codes)  # fmt: skip
    return (q.view(M, K) if codes else None), s.view(M, K // BLOCK), v.view(M, K)


def from_codes(q_MK, s_MB, ws: tuple, offsets_E: Tensor, pow2: bool, floor: float, out_dtype):
    """(fused) x @ w for each w of ws from x's kept 1 x 128 codes, dequantized once (one
    launch) for all of them (the expert MLP's up and gate GEMMs)."""
    from moe.fp8.triton_blocks import dequantize_triton

    x_v = dequantize_triton(q_MK, s_MB, torch.bfloat16)
    return [mm_groups(x_v, weight_values(w, pow2, floor), offsets_E).to(out_dtype) for w in ws]


def forward(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor, pow2: bool, floor: float):
    """(y_MN float32, x's e4m3 bytes as uint8 [M, K], its block scales [M, ceil(K / 128)])."""
    if fused(x_MK, w_EKN, pow2):
        q_MK, s_MB, v_MK = block_rows(x_MK, pow2, floor)
        y = mm_groups(v_MK, weight_values(w_EKN, pow2, floor), offsets_E)
        return y, q_MK.view(torch.uint8), s_MB
    q_MK, s_MB = quantize_blocks(x_MK, BLOCK, pow2, floor)
    x_q = dequantize_blocks(q_MK, s_MB, BLOCK)
    y = mm_exact(x_q, weight(w_EKN, pow2, floor), offsets_E, pow2)
    return y, q_MK.view(torch.uint8), s_MB


def saved_x(q_MK: Tensor, s_MB: Tensor) -> Tensor:
    """x as forward quantized it, float32 (what the wgrad starts from with save_fp8)."""
    return dequantize_blocks(q_MK.view(E4M3), s_MB, BLOCK)


def dgrad(dy_MN: Tensor, w_EKN: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    if fused(dy_MN, w_EKN, pow2):
        w_ENK = weight_values(w_EKN, pow2, floor).transpose(1, 2)  # a view: the same blocks
        return mm_groups(block_rows(dy_MN, pow2, floor, codes=False)[2], w_ENK, offsets_E)
    q_MN, s_MB = quantize_blocks(dy_MN, BLOCK, pow2, floor)
    w_ENK = weight(w_EKN, pow2, floor).transpose(1, 2).contiguous()
    return mm_exact(dequantize_blocks(q_MN, s_MB, BLOCK), w_ENK, offsets_E, pow2)


def _tiles(x_MK: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    q, scales, seg_M = quantize_row_tiles(x_MK, offsets_E, BLOCK, pow2, floor)
    return dequantize(q, scales.index_select(0, seg_M))


def wgrad(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    x_q, dy_q = _tiles(x_MK, offsets_E, pow2, floor), _tiles(dy_MN, offsets_E, pow2, floor)
    return wgrad_exact(x_q, dy_q, offsets_E, pow2)
