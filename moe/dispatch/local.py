"""Single-device dispatch: gather each pair's token into expert-sorted rows, and back."""

import torch

from moe.dispatch.dispatcher import DispatchContext, Dispatcher, register_dispatcher
from moe.dispatch.permute import DispatchPlan, gather_tokens, weighted_sum_rows
from moe.kernels import resolve_backend


@register_dispatcher("local")
class LocalDispatcher(Dispatcher):
    """All experts on this device (the default). The rows are the plan's M pairs (R = M,
    dropped pairs at the tail). On the Triton backend the expert kernel gathers token rows as
    it loads them, so dispatch hands over x_TD with ctx.gather_ids_R instead of a copy."""

    def __init__(self, backend: str = "auto"):
        self.backend = backend

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan):
        backend = resolve_backend(self.backend, x_TD)
        if backend == "triton":
            ctx = DispatchContext(plan, gather_ids_R=plan.token_ids_M)
            return x_TD, plan.offsets_E, ctx
        return gather_tokens(x_TD, plan), plan.offsets_E, DispatchContext(plan)

    def combine(self, out_RD: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        return weighted_sum_rows(out_RD, ctx.plan, resolve_backend(self.backend, out_RD))
