"""The FP8 expert MLP's backward operands, each quantized by ONE launch on CUDA (issue 61).

A gradient dy of the backward feeds two GEMMs: the input gradient (dy row-wise, e4m3 codes and
one scale per row) and the weight gradient (dy's columns scaled within each expert's rows).
On CUDA with the rowwise recipe's power-of-two scales one Triton launch
(moe/fp8/triton_quant.py) writes both from one read of dy: the codes and scales, and the
column-scaled values (e4m3 x 2^k, exact in bf16, the form the bf16 grouped GEMM reads). The
weight gradient's other operand (x, or the down GEMM's input) comes from what the forward kept,
its row-wise codes and scales (gathered through the rows' token ids), dequantized and scaled
per expert column in the same one launch. Same values as the eager chain the custom ops run
elsewhere (moe/fp8/grouped_mm.py: quantize_along, dequantize, quantize_groups), so every device
computes the same products.
"""

import torch
from torch import Tensor

from moe.fp8.grouped_mm import (
    _dgrad_op,
    _dgrad_quantized_op,
    _wgrad_op,
    kept_input,
    wgrad_from_values,
)
from moe.kernels.triton_kernel import triton_installed


def one_launch(t: Tensor, op: tuple) -> bool:
    """The fused operands apply: CUDA, Triton, the rowwise recipe with power-of-two scales."""
    _, pow2, _, recipe = op
    return t.is_cuda and pow2 and recipe == "rowwise" and triton_installed()


class GradOperand:
    """dy for its input-gradient GEMM (`dgrad`, once) and, when fp8_wgrad, the FP8 weight
    gradient (`wgrad`)."""

    def __init__(self, dy: Tensor, op: tuple, fp8_wgrad: bool):
        self.dy, self.op, self.rows, self.values = dy, op, None, None
        offsets, pow2, floor, _ = op
        if one_launch(dy, op):
            from moe.fp8.triton_quant import quantize

            groups = offsets if fp8_wgrad else None
            values = torch.bfloat16 if fp8_wgrad else None
            q, s, self.values, _ = quantize(dy, pow2, floor, groups=groups, values=values)
            self.rows = (q.view(torch.uint8), s)

    def dgrad(self, w: Tensor, out_dtype: torch.dtype) -> Tensor:
        """dx = dy @ w^T per expert, FP8."""
        offsets, pow2, floor, _ = self.op
        rows, self.rows = self.rows, None  # (freed once used)
        if rows is None:
            return _dgrad_op(self.dy, w, *self.op).to(out_dtype)
        return _dgrad_quantized_op(*rows, w, offsets, pow2, floor, out_dtype)

    def wgrad(self, a, w: Tensor) -> Tensor:
        """dw = a^T dy per expert, FP8, in w's dtype; a from `wgrad_input`."""
        if self.values is not None:
            return wgrad_from_values(a, self.values, self.op[0], w.dtype)
        return _wgrad_op(a, self.dy, *self.op, w.dtype)


def wgrad_input(kept: tuple, ids_R: Tensor | None, op: tuple, like: Tensor) -> Tensor:
    """The weight gradient's input operand from what the forward kept: (x,) or its row-wise
    (e4m3 bytes, scales), rows read at ids_R. With one launch (see `one_launch`, asked of
    `like`): its column-scaled values in bf16; else the rows as the eager custom op takes them
    (float32 when kept quantized)."""
    offsets, pow2, floor, recipe = op
    if one_launch(like, op):
        from moe.fp8.triton_quant import quantize

        x = kept[0] if len(kept) == 1 else kept[0].view(torch.float8_e4m3fn)
        scales = None if len(kept) == 1 else kept[1]
        _, _, values, _ = quantize(x, pow2, floor, rows=False, groups=offsets,
                                   values=torch.bfloat16, ids=ids_R, row_scales=scales)  # fmt: skip
        return values
    rows = tuple(t if ids_R is None else t.index_select(0, ids_R) for t in kept)
    return kept_input(rows, recipe)
