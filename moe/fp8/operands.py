"""The FP8 expert MLP's backward operands, each quantized by ONE launch on CUDA (issue 61).

A gradient dy of the backward feeds two GEMMs: the input gradient (dy row-wise: e4m3 codes and
one scale per row, or per 1 x 128 block) and the weight gradient (dy's columns scaled within
each expert's rows, or within each 128-row tile of them). On CUDA with power-of-two scales
(`one_launch`) one Triton launch (moe/fp8/triton_quant.py) writes, for the rowwise recipe,
both from one read of dy: the row codes and scales, and the column codes (transposed, in the
layout the FP8 weight-gradient GEMM reads, moe/fp8/triton_wgrad_gemm.py) with one scale per
(group, column); for the blockwise recipe the column codes (its 1 x 128 blocks are made by the
dgrad: moe/fp8/blockwise.py). The weight gradient's other operand (x, or the down GEMM's
input) comes from what the forward kept, its codes and scales (gathered through the rows' token
ids), dequantized and quantized per column in the same one launch. Same e4m3 values as the
eager chain the custom ops run elsewhere (moe/fp8/grouped_mm.py and blockwise.py: quantize,
dequantize, quantize per expert or tile, dequantize, float32 GEMM), so every device computes
the same products (summed in another order).
"""

import torch
from torch import Tensor

from moe.fp8.blockwise import BLOCK
from moe.fp8.grouped_mm import _dgrad_op, _dgrad_quantized_op, _wgrad_op, kept_input
from moe.kernels.triton_kernel import triton_installed


def one_launch(t: Tensor, op: tuple) -> bool:
    """The fused operands apply: CUDA, Triton, power-of-two scales."""
    return t.is_cuda and op[1] and triton_installed()


def scaling_groups(op: tuple, M: int, like: Tensor) -> Tensor | None:
    """The weight gradient's scaling groups of M rows (int32 ends), made once per backward:
    each expert's (rowwise), each 128-row tile of each expert's (blockwise); None where
    `one_launch` does not apply to `like`."""
    offsets, _, _, recipe = op
    if not one_launch(like, op):
        return None
    from moe.fp8.triton_wgrad_gemm import scaling_groups as groups_of

    return groups_of(offsets, M, recipe)


class GradOperand:
    """dy for its input-gradient GEMM (`dgrad`, once) and, when fp8_wgrad, the FP8 weight
    gradient (`wgrad`)."""

    def __init__(self, dy: Tensor, op: tuple, fp8_wgrad: bool, groups: Tensor | None):
        self.dy, self.op, self.rows, self.cols = dy, op, None, None
        offsets, pow2, floor, recipe = op
        rows = recipe == "rowwise"  # (blockwise: its dgrad quantizes 1 x 128 blocks)
        if groups is not None and fp8_wgrad:
            from moe.fp8.triton_wgrad_gemm import column_codes

            *row, qc, sc = column_codes(dy, groups, offsets, pow2, floor, rows=rows)
            self.cols = (qc, sc)
            self.rows = (row[0].view(torch.uint8), row[1]) if rows else None
        elif groups is not None and rows:
            from moe.fp8.triton_quant import quantize

            q, s, _, _ = quantize(dy, pow2, floor)
            self.rows = (q.view(torch.uint8), s)

    def dgrad(self, w: Tensor, out_dtype: torch.dtype) -> Tensor:
        """dx = dy @ w^T per expert, FP8."""
        offsets, pow2, floor, _ = self.op
        rows, self.rows = self.rows, None  # (freed once used)
        if rows is None:
            return _dgrad_op(self.dy, w, *self.op).to(out_dtype)
        return _dgrad_quantized_op(*rows, w, offsets, pow2, floor, out_dtype)

    def wgrad(self, a, w: Tensor) -> Tensor:
        """dw = a^T dy per expert, FP8, in w's dtype; a from `wgrad_input` (with groups: the
        FP8 weight-gradient GEMM on both operands' column codes)."""
        if self.cols is not None:
            from moe.fp8.triton_wgrad_gemm import fp8_wgrad_gemm

            offsets, _, _, recipe = self.op
            return fp8_wgrad_gemm(a, self.cols, offsets, self.dy.shape[0], recipe, w.dtype)
        return _wgrad_op(a, self.dy, *self.op, w.dtype)


def wgrad_input(kept: tuple, ids_R: Tensor | None, op: tuple, groups: Tensor | None):
    """The weight gradient's input operand from what the forward kept: (x,) or its row-wise
    (e4m3 bytes, scales), rows read at ids_R. With `groups` (scaling_groups'): its column codes
    and scales (moe/fp8/triton_wgrad_gemm.column_codes), one launch; else the rows as the eager
    custom op takes them (float32 when kept quantized)."""
    offsets, pow2, floor, recipe = op
    if groups is not None:
        from moe.fp8.triton_wgrad_gemm import column_codes

        x = kept[0] if len(kept) == 1 else kept[0].view(torch.float8_e4m3fn)
        scales = None if len(kept) == 1 else kept[1]
        block = x.shape[1] if recipe == "rowwise" else BLOCK  # the kept scales' width
        return column_codes(x, groups, offsets, pow2, floor, ids=ids_R, row_scales=scales,
                            scale_block=block)  # fmt: skip
    rows = tuple(t if ids_R is None else t.index_select(0, ids_R) for t in kept)
    return kept_input(rows, recipe)


def kept_values(kept: tuple, ids_R: Tensor | None, recipe: str, dtype: torch.dtype) -> Tensor:
    """The forward's kept x, rows read at ids_R, in dtype (FP8Config.wgrad_bf16's operand): its
    e4m3 codes times their scales (row or 1 x 128 block), one launch on CUDA, where the eager
    dequantize writes float32 first (the same values: one rounding of the float32 product)."""
    rows = tuple(t if ids_R is None else t.index_select(0, ids_R) for t in kept)
    if len(rows) == 2 and rows[0].is_cuda and triton_installed():
        q, s = rows
        K, nb = q.shape[1], s.shape[1]
        if nb == 1 or (recipe == "blockwise" and nb * BLOCK == K):
            from moe.fp8.triton_blocks import dequantize_triton

            return dequantize_triton(q, s, dtype)
    return kept_input(rows, recipe).to(dtype)
