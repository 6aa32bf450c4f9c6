"""A differentiable ragged grouped GEMM on the Triton kernels (ragged_mm for y and dx,
ragged_reduce_mm for dw): the Triton kernels' GroupedGemms (moe/kernels/registry.py), what a
kernel wrapper composes its expert MLP from. Tail rows (at or past offsets[-1])
come out zero, and so do their input gradients; empty groups get zero weight gradients.
Wrapped as torch.library custom ops (fake and autograd registrations) so torch.compile sees
them, as moe::grouped_mm is on the torch path."""

import torch
from torch import Tensor

from moe.kernels.torch_grouped_mm import zero_tail_rows
from moe.kernels.triton.grouped_mm import EPI_PLAIN, ragged_mm
from moe.kernels.triton.grouped_mm_wgrad import ragged_reduce_mm


@torch.library.custom_op("moe::ragged_mm_triton", mutates_args=())
def _mm_op(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    out = x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])
    ragged_mm(x_MK.contiguous(), w_EKN.contiguous(), offsets_E, out, epilogue=EPI_PLAIN)
    return zero_tail_rows(out, offsets_E)


@_mm_op.register_fake
def _(x_MK, w_EKN, offsets_E):
    return x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])


@torch.library.custom_op("moe::ragged_reduce_mm_triton", mutates_args=())
def _wgrad_op(x_MK: Tensor, dy_MN: Tensor, offsets_E: Tensor, num_experts: int) -> Tensor:
    dw = x_MK.new_empty(num_experts, x_MK.shape[1], dy_MN.shape[1])
    ragged_reduce_mm(x_MK.contiguous(), dy_MN.contiguous(), offsets_E, dw)
    return dw


@_wgrad_op.register_fake
def _(x_MK, dy_MN, offsets_E, num_experts):
    return x_MK.new_empty(num_experts, x_MK.shape[1], dy_MN.shape[1])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy_MN):
    x_MK, w_EKN, offsets_E = ctx.saved_tensors
    dy_MN = dy_MN.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _mm_op(dy_MN, w_EKN.transpose(1, 2).contiguous(), offsets_E)
    if ctx.needs_input_grad[1]:
        dw = _wgrad_op(x_MK, dy_MN, offsets_E, w_EKN.shape[0])
    return dx, dw, None


_mm_op.register_autograd(_backward, setup_context=_setup_context)


def ragged_mm_triton(x_MK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e], differentiable in x and w; tail rows zero."""
    return _mm_op(x_MK.contiguous(), w_EKN.contiguous(), offsets_E.to(torch.int32))
