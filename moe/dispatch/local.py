"""Single-device dispatch: gather each pair's token into expert-sorted rows, and back."""

import torch

from moe.dispatch.dispatcher import (
    DispatchContext,
    Dispatcher,
    ExpertFn,
    register_dispatcher,
    rows_only,
)
from moe.dispatch.permute import DispatchPlan
from moe.kernels.combine import sum_rows
from moe.kernels.expert_rows import ExpertRows


@register_dispatcher("local")
class LocalDispatcher(Dispatcher):
    """All experts on this device (the default). The rows are the plan's M pairs (R = M,
    dropped pairs at the tail). The expert kernels gather token rows as they load them, so
    dispatch hands over x_TD with ctx.gather_ids_R instead of a copy, and the combine weights
    as ctx.row_weights_R. When the experts declare that they fuse the combine
    (`experts.fuses_combine`), `run` also asks them to add each row into its token
    (ctx.sum_to_tokens): combine then has nothing left to do and no [R, D] output is kept.

    fuse_combine: what `dispatch` asks for when called on its own (outside `run`); `run`
    fuses when the experts declare it (the layer's one decision, LayerExperts.fuses_combine),
    unless this is False."""

    def __init__(self, fuse_combine: bool = True):
        self.fuse_combine = fuse_combine

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan, *, sum_to_tokens=None):
        """-> (x_TD itself, offsets, ctx): the experts gather their rows from the tokens
        (ctx.gather_ids_R) and, with sum_to_tokens, return y_TD."""
        if sum_to_tokens is None:
            sum_to_tokens = self.fuse_combine
        rows = ExpertRows(
            gather_ids_R=plan.token_ids_M,
            row_weights_R=plan.row_weights(),
            sum_to_tokens=sum_to_tokens,
        )
        ctx = DispatchContext(plan, rows)
        return x_TD, plan.offsets_E, ctx

    def combine(self, out_ND: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """out_ND: y_TD when the experts summed their rows (ctx.sum_to_tokens), else out_RD."""
        if ctx.sum_to_tokens:  # the experts already returned y_TD
            return out_ND
        # weights applied: add each row into its token (no float atomics, see sum_rows)
        return sum_rows(out_ND, ctx.gather_ids_R, ctx.plan.num_tokens)

    def run(self, x_TD, plan, experts: ExpertFn, shared=None):
        experts = rows_only(experts)
        sum_to_tokens = self.fuse_combine and experts.fuses_combine  # the experts decide
        x_TD, offsets_L, ctx = self.dispatch(x_TD, plan, sum_to_tokens=sum_to_tokens)
        ctx.kernel = experts.kernel
        y_TD = self.combine(experts(x_TD, offsets_L, ctx), ctx)
        return y_TD, None if shared is None else shared()
