"""A differentiable ragged grouped GEMM on the Triton kernels (ragged_mm for y and dx,
ragged_reduce_mm for dw): the base and adapter GEMMs of the adapted expert MLP
(moe/kernels/adapted_mlp.py) on the Triton expert kernels. Tail rows (at or past offsets[-1])
come out zero, and so do their input gradients; empty groups get zero weight gradients."""

import torch
from torch import Tensor

from moe.kernels.torch_grouped_mm import zero_tail_rows
from moe.kernels.triton.grouped_mm import EPI_PLAIN, ragged_mm
from moe.kernels.triton.grouped_mm_wgrad import ragged_reduce_mm


def _mm(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    out = x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])
    ragged_mm(x_MK, w_EKN, offsets_E, out, epilogue=EPI_PLAIN)
    return zero_tail_rows(out, offsets_E)


class _RaggedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_EKN, offsets_E):
        ctx.save_for_backward(x_MK, w_EKN, offsets_E)
        return _mm(x_MK, w_EKN, offsets_E)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_EKN, offsets_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _mm(dy_MN, w_EKN.transpose(1, 2), offsets_E)
        if ctx.needs_input_grad[1]:
            dw = x_MK.new_empty(w_EKN.shape)
            ragged_reduce_mm(x_MK, dy_MN, offsets_E, dw)
        return dx, dw, None


def ragged_mm_triton(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e], differentiable in x and w; tail rows zero."""
    return _RaggedMM.apply(x_MK.contiguous(), w_EKN.contiguous(), offsets_E.to(torch.int32))
