"""Single-device dispatch: gather each pair's token into expert-sorted rows, and back."""

import torch

from moe.dispatch.dispatcher import (
    DispatchContext,
    Dispatcher,
    ExpertFn,
    register_dispatcher,
    rows_only,
)
from moe.dispatch.permute import RowMap, weighted_sum_rows
from moe.dispatch.wire import PLAIN_WIRE, RowWire
from moe.kernels.combine import sum_rows
from moe.kernels.expert_rows import ExpertRows


@register_dispatcher("local")
class LocalDispatcher(Dispatcher):
    """All experts on this device (the default). The rows are the row map's M pairs (R = M,
    dropped pairs at the tail). The expert kernels gather token rows as they load them, so
    dispatch hands over x_TD with ctx.gather_ids_R instead of a copy, and the combine weights
    as ctx.row_weights_R. When the experts declare that they fuse the combine
    (`experts.fuses_combine`), `run` also asks them to add each row into its token
    (ctx.sum_to_tokens): combine then has nothing left to do and no [R, D] output is kept.

    fuse_combine: what `dispatch` asks for when called on its own (outside `run`); `run`
    fuses when the experts declare it (the layer's one decision, LayerExperts.fuses_combine),
    unless this is False.

    wire: the layer's RowWire (moe.dispatch.wire.wire_for(config)). One process emulates what
    the expert-parallel exchange does to the rows: each direction in its format (straight-
    through gradient). When the wire is not plain, or the experts' kernel takes no combine
    weights on its rows (`experts.takes_row_weights`: e.g. quantized GEMMs, whose scales see
    the rows as they arrive between ranks), the experts get the rows unweighted and the
    combine weights are applied after them, as between ranks, so the layer computes the same
    function at every layout."""

    def __init__(self, fuse_combine: bool = True, *, wire: RowWire = PLAIN_WIRE):
        self.fuse_combine = fuse_combine
        self.wire = wire

    def dispatch(self, x_TD: torch.Tensor, plan: RowMap, *, sum_to_tokens=None, weights_after=None):
        """-> (x_TD itself, offsets, ctx): the experts gather their rows from the tokens
        (ctx.gather_ids_R) and, with sum_to_tokens, return y_TD; with weights_after (default:
        the wire is not plain) the rows go unweighted and combine weights them."""
        if weights_after is None:
            weights_after = not self.wire.plain
        if sum_to_tokens is None:
            sum_to_tokens = self.fuse_combine
        summed = sum_to_tokens and not weights_after
        rows = ExpertRows(
            gather_ids_R=plan.token_ids_M,
            row_weights_R=None if weights_after else plan.row_weights(),
            sum_to_tokens=summed,
            token_rows_TK=plan.pair_rows_TK if summed else None,
        )
        ctx = DispatchContext(plan, rows)
        return self.wire.local_dispatch(x_TD), plan.offsets_E, ctx

    def combine(self, out_ND: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """out_ND: y_TD when the experts summed their rows (ctx.sum_to_tokens), else out_RD."""
        if ctx.rows.sum_to_tokens:  # the experts already returned y_TD
            return out_ND
        if ctx.rows.row_weights_R is None:  # unweighted rows, weighted here as after an exchange
            out_RD = self.wire.local_combine(out_ND)
            return weighted_sum_rows(out_RD, ctx.plan, ctx.kernel)
        # weights applied: add each row into its token (no float atomics, see sum_rows)
        return sum_rows(out_ND, ctx.rows.gather_ids_R, ctx.plan.num_tokens)

    def run(self, x_TD, plan, experts: ExpertFn, shared=None):
        experts = rows_only(experts)
        weights_after = not (self.wire.plain and experts.takes_row_weights)
        sum_to_tokens = self.fuse_combine and experts.fuses_combine  # the experts decide
        x_TD, offsets_L, ctx = self.dispatch(
            x_TD, plan, sum_to_tokens=sum_to_tokens, weights_after=weights_after
        )
        ctx.kernel = experts.kernel
        y_TD = self.combine(experts(x_TD, offsets_L, ctx), ctx)
        return y_TD, None if shared is None else shared()
