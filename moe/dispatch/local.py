"""Single-device dispatch: gather each pair's token into expert-sorted rows, and back."""

import torch

from moe.dispatch.dispatcher import (
    DispatchContext,
    Dispatcher,
    ExpertFn,
    fuses_combine,
    register_dispatcher,
)
from moe.dispatch.permute import DispatchPlan
from moe.kernels.combine import sum_rows


@register_dispatcher("local")
class LocalDispatcher(Dispatcher):
    """All experts on this device (the default). The rows are the plan's M pairs (R = M,
    dropped pairs at the tail). The expert kernels gather token rows as they load them, so
    dispatch hands over x_TD with ctx.gather_ids_R instead of a copy, and the combine weights
    as ctx.row_weights_R. When the experts declare that they fuse the combine
    (`fuses_combine(experts)`), `run` also asks them to add each row into its token
    (ctx.sum_to_tokens): combine then has nothing left to do and no [R, D] output is kept.

    fuse_combine: what `dispatch` asks for when called on its own (outside `run`); `run`
    asks the experts and fuses only if both agree. `backend` is accepted and unused (the
    experts own their backend)."""

    def __init__(self, backend: str = "auto", fuse_combine: bool = True):
        self.backend, self.fuse_combine = backend, fuse_combine

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan, *, sum_to_tokens=None):
        fuse = self.fuse_combine if sum_to_tokens is None else sum_to_tokens
        ctx = DispatchContext(plan, plan.token_ids_M, plan.row_weights(), fuse)
        return x_TD, plan.offsets_E, ctx

    def combine(self, out_RD: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        if ctx.sum_to_tokens:  # the experts already returned y_TD
            return out_RD
        # weights applied: add each row into its token (no float atomics, see sum_rows)
        return sum_rows(out_RD, ctx.gather_ids_R, ctx.plan.num_tokens)

    def run(self, x_TD, plan, experts: ExpertFn, shared=None):
        fuse = self.fuse_combine and fuses_combine(experts)
        x_TD_, offsets_L, ctx = self.dispatch(x_TD, plan, sum_to_tokens=fuse)
        y_TD = self.combine(experts(x_TD_, offsets_L, ctx), ctx)
        return y_TD, None if shared is None else shared()
