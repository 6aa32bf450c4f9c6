"""Single-device dispatch: gather each pair's token into expert-sorted rows, and back."""

import torch

from moe.dispatch.dispatcher import DispatchContext, Dispatcher, register_dispatcher
from moe.dispatch.permute import DispatchPlan
from moe.kernels.combine import sum_rows


@register_dispatcher("local")
class LocalDispatcher(Dispatcher):
    """All experts on this device (the default). The rows are the plan's M pairs (R = M,
    dropped pairs at the tail). The expert kernels gather token rows as they load them, so
    dispatch hands over x_TD with ctx.gather_ids_R instead of a copy. On both backends the
    experts also apply the combine weights and add each row into its token (ctx.row_weights_R,
    ctx.sum_to_tokens), so combine has nothing left to do and no [R, D] output is kept."""

    def __init__(self, backend: str = "auto", fuse_combine: bool = True):
        self.backend, self.fuse_combine = backend, fuse_combine

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan):
        ctx = DispatchContext(plan, plan.token_ids_M, plan.row_weights(), self.fuse_combine)
        return x_TD, plan.offsets_E, ctx

    def combine(self, out_RD: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        if ctx.sum_to_tokens:  # the experts already returned y_TD
            return out_RD
        # weights applied: add each row into its token (no float atomics, see sum_rows)
        return sum_rows(out_RD, ctx.gather_ids_R, ctx.plan.num_tokens)
