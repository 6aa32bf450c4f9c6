"""Single-device dispatch: gather each pair's token into expert-sorted rows, and back."""

import torch

from moe.dispatch.dispatcher import DispatchContext, Dispatcher, register_dispatcher
from moe.dispatch.permute import DispatchPlan, weighted_sum_rows
from moe.kernels import resolve_backend


@register_dispatcher("local")
class LocalDispatcher(Dispatcher):
    """All experts on this device (the default). The rows are the plan's M pairs (R = M,
    dropped pairs at the tail). The expert kernels gather token rows as they load them, so
    dispatch hands over x_TD with ctx.gather_ids_R instead of a copy. On the torch backend the
    experts also apply the combine weights and add each row into its token (ctx.row_weights_R,
    ctx.sum_to_tokens), so no [R, D] buffer exists; the Triton path combines in its own
    gather-sum kernel."""

    def __init__(self, backend: str = "auto", fuse_combine: bool = True):
        self.backend, self.fuse_combine = backend, fuse_combine

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan):
        if resolve_backend(self.backend, x_TD) == "triton":
            return x_TD, plan.offsets_E, DispatchContext(plan, gather_ids_R=plan.token_ids_M)
        ctx = DispatchContext(plan, plan.token_ids_M, plan.row_weights(), self.fuse_combine)
        return x_TD, plan.offsets_E, ctx

    def combine(self, out_RD: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        if ctx.sum_to_tokens:  # the experts already returned y_TD
            return out_RD
        if ctx.row_weights_R is not None:  # weights applied: add each row into its token
            y_TD = out_RD.new_zeros(ctx.plan.num_tokens, out_RD.shape[1])
            return y_TD.index_add_(0, ctx.gather_ids_R, out_RD)
        return weighted_sum_rows(out_RD, ctx.plan, resolve_backend(self.backend, out_RD))
