"""The blockwise recipe's three GEMMs (DeepSeek-V3's scaling), emulated: e4m3 operands
dequantized to float32, then the grouped GEMM (moe/fp8/exact_mm.py: bf16 tensor cores on CUDA
with power-of-two scales, float32 elsewhere).

- forward  y = x @ w:     x one scale per 1 x 128 block along K, w one per 128 x 128 block;
- dgrad   dx = dy @ w^T:  dy one scale per 1 x 128 block along N, w the same 128 x 128 blocks;
- wgrad   dw = x^T @ dy:  x and dy one scale per column within each 128-row tile of one
  expert's rows (128 x 1 blocks along the tokens, restarting at every expert).
Partial blocks at the edges (widths not multiples of 128, experts with rows % 128 != 0).
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

BLOCK = 128


def weight(w_EKN: Tensor, pow2: bool, floor: float) -> Tensor:
    """w through its 128 x 128 blocks, float32: its e4m3 codes and block scales are made once
    per optimizer step (moe/fp8/weight_cache.py) and serve the forward and, transposed, the
    dgrad (square blocks: the transposed weight is a re-index of the same codes and scales)."""
    q, s = cached_form(  # 1 byte per element kept
        ("blocks", pow2, floor), w_EKN, lambda w: quantize_weight_blocks(w, BLOCK, pow2, floor)
    )
    return dequantize(q, expand_weight_blocks(s, *w_EKN.shape[1:], BLOCK))


def forward(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor, pow2: bool, floor: float):
    """(y_MN float32, x's e4m3 bytes as uint8 [M, K], its block scales [M, ceil(K / 128)])."""
    q_MK, s_MB = quantize_blocks(x_MK, BLOCK, pow2, floor)
    x_q = dequantize_blocks(q_MK, s_MB, BLOCK)
    y = mm_exact(x_q, weight(w_EKN, pow2, floor), offsets_E, pow2)
    return y, q_MK.view(torch.uint8), s_MB


def saved_x(q_MK: Tensor, s_MB: Tensor) -> Tensor:
    """x as forward quantized it, float32 (what the wgrad starts from with save_fp8)."""
    return dequantize_blocks(q_MK.view(E4M3), s_MB, BLOCK)


def dgrad(dy_MN: Tensor, w_EKN: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    q_MN, s_MB = quantize_blocks(dy_MN, BLOCK, pow2, floor)
    w_ENK = weight(w_EKN, pow2, floor).transpose(1, 2).contiguous()
    return mm_exact(dequantize_blocks(q_MN, s_MB, BLOCK), w_ENK, offsets_E, pow2)


def _tiles(x_MK: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    q, scales, seg_M = quantize_row_tiles(x_MK, offsets_E, BLOCK, pow2, floor)
    return dequantize(q, scales.index_select(0, seg_M))


def wgrad(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    x_q, dy_q = _tiles(x_MK, offsets_E, pow2, floor), _tiles(dy_MN, offsets_E, pow2, floor)
    return wgrad_exact(x_q, dy_q, offsets_E, pow2)
