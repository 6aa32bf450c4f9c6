"""The blockwise recipe's three GEMMs (DeepSeek-V3's scaling), emulated: e4m3 operands
dequantized to float32, then the grouped GEMM (moe/fp8/exact_mm.py: bf16 tensor cores on CUDA
with power-of-two scales, float32 elsewhere).

- forward  y = x @ w:     x one scale per 1 x 128 block along K, w one per 128 x 128 block;
- dgrad   dx = dy @ w^T:  dy one scale per 1 x 128 block along N, w the same 128 x 128 blocks;
- wgrad   dw = x^T @ dy:  x and dy one scale per column within each 128-row tile of one
  expert's rows (128 x 1 blocks along the tokens, restarting at every expert).
Partial blocks at the edges (widths not multiples of 128, experts with rows % 128 != 0).

On CUDA with power-of-two scales and widths that are multiples of 128 (`fused`) the forward and
dgrad GEMMs read e4m3 codes and their scales directly (moe/fp8/triton_block_gemm.py: the
scales applied per 128-wide K block to a float32 sum, DeepGEMM's promotion): x's and dy's
1 x 128 codes from one quantization launch each, the weight's 128 x 128 block codes in both
orientations and its scales made once per optimizer step (moe/fp8/triton_blocks.py); the
expert MLP's up and gate input gradients in one launch (`dgrad_pair`), and its up and gate
GEMMs with the SwiGLU and the down GEMM's quantization in their epilogue (`up_gate_swiglu`).
The weight gradient's per-tile column codes come from one launch (moe/fp8/operands.py) and
run on the FP8 weight-gradient GEMM (moe/fp8/triton_wgrad_gemm.py). The same products as the eager chain
below, which every other device runs, summed in another order.
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


def weight_codes(w_EKN: Tensor, pow2: bool, floor: float) -> tuple:
    """(fused) w's 128 x 128 block codes [E, K, N] (the dgrad's operand: K-contiguous w^T),
    the same codes [E, N, K] (the forward's) and the block scales [E, K / 128, N / 128], made
    once per optimizer step (one launch)."""
    from moe.fp8.triton_blocks import weight_blocks_triton

    make = lambda w: weight_blocks_triton(w, BLOCK, pow2, floor)  # noqa: E731
    return cached_form(("block codes", pow2, floor), w_EKN, make)


def block_gemm(q_MK, s_MB, w_EKN, offsets_E, pow2: bool, floor: float, out_dtype, dgrad=False):
    """(fused) x @ w (or, dgrad, dy @ w^T) per group from the 1 x 128 codes and scales of x
    (dy), on w's cached codes, in out_dtype; tail rows zero."""
    from moe.fp8.triton_block_gemm import block_mm

    b = _b_operand(w_EKN, pow2, floor, dgrad)
    return block_mm(q_MK, s_MB, *b, offsets_E, out_dtype)


def _b_operand(w_EKN: Tensor, pow2: bool, floor: float, dgrad: bool) -> tuple:
    """(codes, scales) of w (dgrad: of w^T) as [E, K, N] views, K contiguous."""
    q_EKN, s_EKN, q_ENK = weight_codes(w_EKN, pow2, floor)
    if dgrad:
        return q_EKN.transpose(1, 2), s_EKN.transpose(1, 2)
    return q_ENK.transpose(1, 2), s_EKN


def dgrad_pair(dh_MN, dg_MN, w1_EKN, w3_EKN, offsets_E, pow2: bool, floor: float, out_dtype):
    """(fused) dh @ w1^T + dg @ w3^T per group, one launch and one float32 sum (the SwiGLU
    MLP's input gradient), in out_dtype; tail rows zero."""
    from moe.fp8.triton_block_gemm import block_mm

    q_h, s_h = quantize_blocks(dh_MN, BLOCK, pow2, floor)
    q_g, s_g = quantize_blocks(dg_MN, BLOCK, pow2, floor)
    b1, b3 = (_b_operand(w, pow2, floor, True) for w in (w1_EKN, w3_EKN))
    return block_mm(q_h, s_h, *b1, offsets_E, out_dtype, q_g, s_g, *b3)


def from_codes(q_MK, s_MB, ws: tuple, offsets_E: Tensor, pow2: bool, floor: float, out_dtype):
    """(fused) x @ w for each w of ws from x's kept 1 x 128 codes (the expert MLP's up and gate
    GEMMs share them)."""
    return [block_gemm(q_MK, s_MB, w, offsets_E, pow2, floor, out_dtype) for w in ws]


def swiglu_epilogue(activation: str, w3, b1, w_R1, dtype: torch.dtype) -> bool:
    """(fused) The up and gate GEMMs can run with the SwiGLU and the down GEMM's quantization
    in their epilogue (`up_gate_swiglu`): swiglu, no bias b1, x bf16 or float32, row weights
    (if any) in x's dtype."""
    return (
        activation == "swiglu" and w3 is not None and b1 is None
        and dtype in (torch.bfloat16, torch.float32) and (w_R1 is None or w_R1.dtype == dtype)
    )  # fmt: skip


def up_gate_swiglu(q_MK, s_MB, w1_EKN, w3_EKN, w_M1, offsets_E, pow2: bool, floor: float, dtype):
    """(fused) h = x @ w1, g = x @ w3 in dtype from x's 1 x 128 codes, and the down GEMM's
    input a = silu(h) * g [* w_M1] as e4m3 bytes (uint8) and 1 x 128 scales, in one launch
    (moe/fp8/triton_swiglu_mm.py): the values of from_codes, the activation and forward's
    quantization."""
    from moe.fp8.triton_swiglu_mm import swiglu_mm

    b1, b3 = (_b_operand(w, pow2, floor, False) for w in (w1_EKN, w3_EKN))
    h, g, q, s = swiglu_mm(q_MK, s_MB, *b1, *b3, offsets_E, dtype, w_M1, pow2, floor)
    return h, g, q.view(torch.uint8), s


def forward(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor, pow2: bool, floor: float):
    """(y_MN in x's dtype, x's e4m3 bytes as uint8 [M, K], its block scales [M, ceil(K / 128)])."""
    q_MK, s_MB = quantize_blocks(x_MK, BLOCK, pow2, floor)
    if fused(x_MK, w_EKN, pow2):
        y = block_gemm(q_MK, s_MB, w_EKN, offsets_E, pow2, floor, x_MK.dtype)
    else:
        x_q = dequantize_blocks(q_MK, s_MB, BLOCK)
        y = mm_exact(x_q, weight(w_EKN, pow2, floor), offsets_E, pow2).to(x_MK.dtype)
    return y, q_MK.view(torch.uint8), s_MB


def saved_x(q_MK: Tensor, s_MB: Tensor) -> Tensor:
    """x as forward quantized it, float32 (what the wgrad starts from with save_fp8)."""
    return dequantize_blocks(q_MK.view(E4M3), s_MB, BLOCK)


def dgrad(dy_MN: Tensor, w_EKN: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    """dx_MK in dy's dtype."""
    q_MN, s_MB = quantize_blocks(dy_MN, BLOCK, pow2, floor)
    if fused(dy_MN, w_EKN, pow2):
        return block_gemm(q_MN, s_MB, w_EKN, offsets_E, pow2, floor, dy_MN.dtype, dgrad=True)
    w_ENK = weight(w_EKN, pow2, floor).transpose(1, 2).contiguous()
    dx = mm_exact(dequantize_blocks(q_MN, s_MB, BLOCK), w_ENK, offsets_E, pow2)
    return dx.to(dy_MN.dtype)


def _tiles(x_MK: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    q, scales, seg_M = quantize_row_tiles(x_MK, offsets_E, BLOCK, pow2, floor)
    return dequantize(q, scales.index_select(0, seg_M))


def wgrad(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor, pow2: bool, floor: float) -> Tensor:
    x_q, dy_q = _tiles(x_MK, offsets_E, pow2, floor), _tiles(dy_MN, offsets_E, pow2, floor)
    return wgrad_exact(x_q, dy_q, offsets_E, pow2)
