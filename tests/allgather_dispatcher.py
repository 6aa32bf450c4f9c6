"""A new expert-parallel strategy as one class plus one registration: every rank all-gathers
every rank's kept rows, computes those of its own experts, and all-gathers the outputs back.
Exact but slow (W times the traffic, host syncs); it exists to show the dispatcher seam."""

import torch
import torch.distributed as dist

from moe.dispatch import (
    DispatchContext,
    Dispatcher,
    gather_tokens,
    register_dispatcher,
    weighted_sum_rows,
)


class _AllGatherRows(torch.autograd.Function):
    """[N, D] per rank -> [W * N, D] (rank-major); backward sums the gradients of my slice."""

    @staticmethod
    def forward(ctx, x_ND, group):
        ctx.group = group
        parts = [torch.empty_like(x_ND) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_ND.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_ND):
        grad_ND = grad_ND.contiguous()
        dist.all_reduce(grad_ND, group=ctx.group)
        rank, n = dist.get_rank(ctx.group), grad_ND.shape[0] // dist.get_world_size(ctx.group)
        return grad_ND[rank * n : (rank + 1) * n], None


def _gather_padded(x_N, group, length: int, fill: int = 0):
    """All-gather every rank's rows, padded with `fill` to a common length."""
    pad = x_N.new_full((length - x_N.shape[0], *x_N.shape[1:]), fill)
    return _AllGatherRows.apply(torch.cat([x_N, pad]), group)


def _max_over_ranks(n: int, group) -> int:
    n_W = torch.tensor([n])
    dist.all_reduce(n_W, op=dist.ReduceOp.MAX, group=group)
    return max(int(n_W), 1)


@register_dispatcher("allgather")
class AllGatherDispatcher(Dispatcher):
    def __init__(self, group, num_local_experts: int, **exchange):
        """parallelize's signature; the all-to-all settings (algorithm=, ...) do not apply."""
        self.group, self.num_local = group, num_local_experts

    def dispatch(self, x_TD, plan):
        rank, L = dist.get_rank(self.group), self.num_local
        kept = int(plan.counts_E.sum())
        width = _max_over_ranks(kept, self.group)
        expert_N = torch.repeat_interleave(torch.arange(len(plan.counts_E)), plan.counts_E)
        x_all = _gather_padded(gather_tokens(x_TD, plan)[:kept], self.group, width)
        expert_all = _gather_padded(expert_N, self.group, width, fill=-1)
        local_all = (expert_all >= rank * L) & (expert_all < (rank + 1) * L)
        rows_R = local_all.nonzero().squeeze(1)
        rows_R = rows_R[torch.argsort(expert_all[rows_R], stable=True)]
        counts_L = torch.bincount(expert_all[rows_R] - rank * L, minlength=L)
        ctx = DispatchContext(plan)
        ctx.rows_R, ctx.kept, ctx.width = rows_R, kept, width
        return x_all.index_select(0, rows_R), torch.cumsum(counts_L, 0).to(torch.int32), ctx

    def combine(self, out_RD, ctx):
        rank = dist.get_rank(self.group)
        width = _max_over_ranks(out_RD.shape[0], self.group)
        out_all = _gather_padded(out_RD, self.group, width)
        where_all = _gather_padded(
            ctx.rows_R, self.group, width, fill=-1
        )  # computed row -> position
        source = torch.full((ctx.width * dist.get_world_size(self.group),), -1)
        valid = where_all >= 0
        source[where_all[valid]] = valid.nonzero().squeeze(1)
        mine = source[rank * ctx.width : rank * ctx.width + ctx.kept]
        out_MD = out_all.index_select(0, mine)
        out_MD = torch.cat(
            [out_MD, out_MD.new_zeros(ctx.plan.num_rows - ctx.kept, out_MD.shape[1])]
        )
        return weighted_sum_rows(out_MD, ctx.plan, ctx.kernel)
