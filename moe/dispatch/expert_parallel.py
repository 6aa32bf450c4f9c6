"""Expert-parallel dispatch: send each kept row to the rank holding its expert (uneven
all-to-all, flat or hierarchical), reorder to expert-major, and the reverse on combine."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.comm.alltoall import ALGORITHMS, AllToAllSplits
from moe.comm.exchange_config import ExchangeConfig
from moe.comm.expert_exchange import ExpertExchange, exchange_expert_counts
from moe.comm.topology import resolve_ranks_per_node
from moe.dispatch.dispatcher import DispatchContext, Dispatcher, register_dispatcher
from moe.dispatch.permute import (
    RowMap,
    gather_tokens,
    permute_rows,
    sort_rows_by_expert,
    weighted_sum_rows,
)
from moe.dispatch.replica_split import (
    Candidates,
    check_layouts_agree,
    copy_candidates,
    with_layout_check,
)
from moe.dispatch.wire import PLAIN_WIRE, RowWire
from moe.kernels.expert_rows import ExpertRows

KEPT_ROWS = ExpertRows(all_rows_kept=True)  # only kept rows travel: no dropped tail


def receive_order(
    recv_WL: torch.Tensor, first: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_R, inverse_R): received rows come (source rank, local expert)-major, the
    experts want them expert-major. recv_WL: rows received from each rank for each of the
    local experts first, first + 1, ... (its columns); num_rows = recv_WL.sum()."""
    W, n = recv_WL.shape
    expert_R = torch.repeat_interleave(
        torch.arange(first, first + n, device=recv_WL.device).repeat(W),
        recv_WL.reshape(-1),
        output_size=num_rows,
    )
    return sort_rows_by_expert(expert_R)


@dataclass
class ExpertParallelContext(DispatchContext):
    a2a: AllToAllSplits | None = None  # the rows' exchange (its algorithm is ctx.algorithm)
    order_R: torch.Tensor | None = None  # received (source rank, expert) order -> expert-major
    inverse_R: torch.Tensor | None = None


@register_dispatcher("expert_parallel")
class ExpertParallelDispatcher(Dispatcher):
    """Installed as `MoELayer.dispatcher` by parallelize(): global expert e lives on EP rank
    e // L. The plan's counts (global E = W * L) are exchanged first, one small collective
    (moe.comm.exchange_expert_counts, in every algorithm), so each rank knows how many rows it
    receives per (source rank, local expert) and which algorithm moves them.

    wire: the layer's RowWire (moe.dispatch.wire.wire_for(layer.config), which parallelize
    hands over): the rows travel by `self.wire`, each direction in its row format, through
    whatever algorithm moves them (flat or hierarchical: encoded rows are rows like any).

    ranks_per_node: resolved here once (moe.comm.topology.resolve_ranks_per_node: the argument,
    else the ExchangeConfig, else detection, a collective over `group` when host names decide)
    and passed to every exchange; the replica split reads the same value (copy_candidates: this
    rank's copies first, then its node's), with this rank's place in the group fixed here."""

    takes_wire = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_local_experts: int,
        algorithm: str = "auto",
        ranks_per_node: int | None = None,
        exchange_config: ExchangeConfig | None = None,
        wire: RowWire = PLAIN_WIRE,
    ):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if num_local_experts < 1:
            raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")
        self.group, self.num_local = group, num_local_experts
        self.ep_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        if exchange_config is not None and not isinstance(exchange_config, ExchangeConfig):
            raise ValueError(
                f"exchange_config must be an ExchangeConfig, got {type(exchange_config).__name__}"
            )
        self.exchange_config = exchange_config or ExchangeConfig()  # the all-to-all's settings
        self.algorithm = algorithm
        self.ranks_per_node = resolve_ranks_per_node(group, ranks_per_node, self.exchange_config)
        self.wire = wire  # how the rows travel: each direction's row format

    def copy_candidates(self, expert_of_slot_S: torch.Tensor, num_experts: int) -> Candidates:
        """This rank's copies first, then those on its node (slot s is on rank s // L)."""
        return copy_candidates(
            expert_of_slot_S, num_experts, self.ep_rank, self.num_local, self.ranks_per_node
        )

    def _check_rows(self, plan: RowMap) -> None:
        W, L = self.ep_size, self.num_local
        if plan.counts_E.numel() != W * L:  # checked before any collective
            raise ValueError(
                f"plan has {plan.counts_E.numel()} experts; this dispatcher expects "
                f"num_local_experts={L} x {W} ranks = {W * L}"
            )

    def _exchange_counts(
        self, x_TD: torch.Tensor, plan: RowMap, extra: torch.Tensor | None = None
    ) -> ExpertExchange:
        """The one count collective of this call (moe.comm.exchange_expert_counts): host and
        device counts and the resolved algorithm, which the contexts carry to the layer."""
        self._check_rows(plan)
        counts_WL = plan.counts_E.view(self.ep_size, self.num_local)
        row_bytes = self.wire.dispatch_format.row_bytes(x_TD.shape[1], x_TD.element_size())
        counts = exchange_expert_counts(
            counts_WL,
            row_bytes,
            self.group,
            self.algorithm,
            self.ranks_per_node,
            with_layout_check(plan, extra),  # the layer's slot layout, checked on every rank
            self.exchange_config,
        )
        check_layouts_agree(plan, counts.extras_W)
        return counts

    def dispatch(self, x_TD: torch.Tensor, plan: RowMap):
        counts = self._exchange_counts(x_TD, plan)
        a2a = counts.splits()
        x_MD = gather_tokens(x_TD, plan)
        recv_RD = self.wire.dispatch(x_MD[: sum(a2a.send)], a2a)
        order_R, inverse_R = receive_order(counts.recv_counts_WL, 0, recv_RD.shape[0])
        offsets_L = torch.cumsum(counts.recv_counts_WL.sum(0), 0).to(torch.int32)
        ctx = ExpertParallelContext(
            plan,
            KEPT_ROWS,
            algorithm=a2a.algorithm,
            a2a=a2a,
            order_R=order_R,
            inverse_R=inverse_R,
        )
        return permute_rows(recv_RD, order_R, inverse_R), offsets_L, ctx

    def combine(self, out_RD: torch.Tensor, ctx: ExpertParallelContext) -> torch.Tensor:
        """The rows back to their ranks, then the weighted sum on the experts' kernel's
        combine (ctx.kernel; the torch one when dispatch / combine are called directly)."""
        back_RD = permute_rows(out_RD, ctx.inverse_R, ctx.order_R)
        out_kept_ND = self.wire.combine(back_RD, ctx.a2a.reverse())
        num_dropped = ctx.plan.num_rows - out_kept_ND.shape[0]
        out_MD = torch.cat([out_kept_ND, out_kept_ND.new_zeros(num_dropped, out_RD.shape[1])])
        return weighted_sum_rows(out_MD, ctx.plan, ctx.kernel)
