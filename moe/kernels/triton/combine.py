"""Combine on Triton: y[t] = sum_j weights_TK[t, j] * out_MD[pair_rows_TK[t, j]], as custom ops.

A gather-sum over the inverse permutation (no scatter, no float atomics); its backward writes
each pair's row gradient once (a permutation write) and reduces the combine-weight gradient per
pair in registers. Kernels: moe/kernels/triton/gather_sum.py. Semantics: moe/kernels/combine.py.
"""

import torch
from torch import Tensor

from moe.kernels.triton.common import check_device, out_dtype_ok
from moe.kernels.triton.gather_sum import combine_bwd, combine_fwd


@torch.library.custom_op("moe::triton_combine", mutates_args=())
def _combine_op(out_MD: Tensor, pair_rows_TK: Tensor, weights_TK: Tensor) -> Tensor:
    check_device(out_MD, pair_rows_TK, weights_TK)
    out_dtype_ok(out_MD.dtype)
    return combine_fwd(out_MD, pair_rows_TK, weights_TK)


@_combine_op.register_fake
def _combine_fake(out_MD, pair_rows_TK, weights_TK):
    return out_MD.new_empty(pair_rows_TK.shape[0], out_MD.shape[1])


@torch.library.custom_op("moe::triton_combine_backward", mutates_args=())
def _combine_bwd_op(
    dy_TD: Tensor, out_MD: Tensor, pair_rows_TK: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    check_device(dy_TD, out_MD, pair_rows_TK, weights_TK)
    return combine_bwd(dy_TD.contiguous(), out_MD, pair_rows_TK, weights_TK)


@_combine_bwd_op.register_fake
def _combine_bwd_fake(dy_TD, out_MD, pair_rows_TK, weights_TK):
    return torch.empty_like(out_MD), torch.empty_like(weights_TK)


def _setup_context(ctx, inputs, output):
    out_MD, pair_rows_TK, weights_TK = inputs
    ctx.save_for_backward(out_MD, pair_rows_TK, weights_TK)


def _backward(ctx, dy_TD):
    out_MD, pair_rows_TK, weights_TK = ctx.saved_tensors
    d_out, d_weights = _combine_bwd_op(dy_TD, out_MD, pair_rows_TK, weights_TK)
    need = ctx.needs_input_grad
    return d_out if need[0] else None, None, d_weights if need[2] else None


_combine_op.register_autograd(_backward, setup_context=_setup_context)


def combine_triton(out_MD: Tensor, pair_rows_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """Weighted sum of each token's k expert rows; output in out_MD's dtype (fp32 accumulation).

    Dropped pairs carry weight 0 (and may all point at one shared zero row); row indices outside
    [0, M) contribute zero. Gradients reach out_MD and weights_TK (returned in fp32).
    """
    return _combine_op(
        out_MD.contiguous(),
        pair_rows_TK.to(torch.int64).contiguous(),
        weights_TK.to(torch.float32).contiguous(),
    )
