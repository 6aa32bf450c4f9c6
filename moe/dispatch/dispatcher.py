"""The dispatcher seam: how token rows reach the experts that compute them and come back.

A dispatcher owns the path between the row map (RowMap) and the experts, and back:

    x_ND, offsets_L, ctx = dispatcher.dispatch(x_TD, plan)   # what the experts read
    out_ND = experts(x_ND, offsets_L, ctx)  # an ExpertFn: the layer's LayerExperts
    y_TD = dispatcher.combine(out_ND, ctx)  # weighted sum back to tokens (if not done above)

N names what is handed over: the R rows of this rank's experts (x_RD -> out_RD), or, when
ctx.gather_ids_R is set, the token matrix itself (x_TD: the experts gather on load) and, when
ctx.sum_to_tokens is set too, the token sum (out is y_TD: the experts did the combine).
The experts declare whether they can take the combine over (`experts.fuses_combine`: the
layer decides it once, LayerExperts); their kernel (`experts.kernel`, an ExpertKernel) is the
one whose combine a dispatcher runs when they return rows.

MoELayer calls `dispatcher.run(x_TD, plan, experts, shared)`, whose default is exactly the
three lines above (then the shared experts). A new strategy (another all-to-all, a
node-aware exchange) is one file: a subclass plus `@register_dispatcher("name")`, which
`parallelize(..., dispatcher="name")` installs as `MoELayer.dispatcher`. The constructor
contract (docs/architecture.md, "A dispatcher"): parallelize calls
`cls(ep_group, num_local_experts, algorithm=, ranks_per_node=, exchange_config=)`, where
ranks_per_node is already resolved (an int, moe.comm.topology.resolve_ranks_per_node) and
exchange_config is the ExchangeConfig the ranks agreed on; plus `degree=` only for a class
declaring `overlaps = True` (when `overlap=` is given) and `wire=` only for one declaring
`takes_wire = True` (when the layer's rows travel in a row format other than plain,
moe/dispatch/wire.py). Those class attributes are the dispatcher's declared capabilities,
checked before any exchange (as kernels declare devices and dtypes); ExpertParallelDispatcher
takes all of it, so subclassing it is enough (its rows travel by `self.wire`).
A strategy that interleaves exchange and compute (the overlapped dispatcher) overrides `run`
instead and calls the experts in parts (`ExpertFn.call_once` and `ExpertFn.part`). Every rank
of a distributed dispatcher must call dispatch and combine (or run) once per forward, also
with zero tokens, so collectives match.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe.dispatch.permute import RowMap
from moe.dispatch.replica_split import Candidates, local_candidates
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows
from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.registry import ExpertKernel
from moe.names import DISPATCHERS


class ExpertFn(ABC):
    """The layer's experts as every dispatcher calls them (moe.experts.LayerExperts for a
    layer; `rows_only` wraps a plain function of the rows).

    `experts(x_ND, offsets_L, ctx)` computes all L local experts on their rows (expert-major,
    int32 row ends offsets_L) with ctx.expert_rows() (gather on load: x_ND is x_TD; combine
    weights; sum into tokens: the result is y_TD). A dispatcher that calls the experts in
    parts (moe.dispatch.overlapped) runs `call_once(x, compute)`: compute(x, weights) inside
    one call of the experts module, so FSDP2 gathers and reduces the weights once, weights
    being the local ExpertWeights (None for experts without weights of their own); compute
    then calls `part(x_RD, offsets_L, ctx, weights, first)` for each part: weights is
    weights.slice(first, n) (or leaves made from it), the rows belong to local experts in that
    range and offsets_L still covers all L experts.
    `kernel`: the ExpertKernel the experts run on, whose `combine` a dispatcher uses for rows
    it sums itself (None: the torch combine).
    """

    kernel: ExpertKernel | None = None

    @property
    def fuses_combine(self) -> bool:
        """Whether the experts apply the combine themselves (gather on load, row weights, sum
        into tokens: the ExpertRows contract of moe.kernels.expert_mlp)."""
        return False

    @property
    def takes_row_weights(self) -> bool:
        """Whether the rows may come weighted by the combine weights (ExpertRows.row_weights_R);
        False: they must come unweighted, the combine weighs them after (e.g. quantized GEMMs
        whose per-row scales must see the rows as they arrive)."""
        return True

    @abstractmethod
    def __call__(
        self, x_ND: torch.Tensor, offsets_L: torch.Tensor, ctx: "DispatchContext"
    ) -> torch.Tensor:
        """All L local experts on their rows -> out_RD (or y_TD with ctx.sum_to_tokens)."""

    def call_once(self, x: torch.Tensor, compute: Callable) -> torch.Tensor:
        """compute(x, weights) within one call of the experts module (no weights: None)."""
        return compute(x, None)

    def part(
        self,
        x_RD: torch.Tensor,
        offsets_L: torch.Tensor,
        ctx: "DispatchContext",
        weights: ExpertWeights | None,
        first: int,
    ) -> torch.Tensor:
        """The local experts [first, first + weights.num_experts) with `weights` (a slice of
        call_once's); without weights, all of them on these rows."""
        return self(x_RD, offsets_L, ctx)


@dataclass(frozen=True)
class _RowsOnly(ExpertFn):
    """A plain function (x_ND, offsets_L, ctx) -> out_ND as an ExpertFn (no weights of its
    own to hand over, no fused combine, the torch combine)."""

    fn: Callable[..., torch.Tensor]

    def __call__(self, x_ND, offsets_L, ctx):
        return self.fn(x_ND, offsets_L, ctx)


def rows_only(experts: "ExpertFn | Callable[..., torch.Tensor]") -> ExpertFn:
    """`experts` as an ExpertFn: itself, or a plain function of (x_ND, offsets_L, ctx)."""
    return experts if isinstance(experts, ExpertFn) else _RowsOnly(experts)


def register_dispatcher(name: str):
    """Class decorator: make a dispatcher constructible by `build_dispatcher(name, ...)`."""

    def add(cls):
        if name in DISPATCHERS and DISPATCHERS[name] is not cls:
            raise ValueError(f"dispatcher {name!r} is already registered")
        DISPATCHERS[name] = cls
        return cls

    return add


def build_dispatcher(name: str, **kwargs) -> "Dispatcher":
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher={name!r} is not one of {sorted(DISPATCHERS)}")
    return DISPATCHERS[name](**kwargs)


@dataclass
class DispatchContext:
    """What combine needs to undo dispatch. Subclasses add their own fields.

    rows: what the experts are told about the rows (ExpertRows, moe/kernels/expert_rows.py):
    gather_ids_R (the rows are the un-gathered tokens x_TD, expert row r being
    x_TD[gather_ids_R[r]]: LocalDispatcher hands them over so, the kernels gather on load),
    row_weights_R (the combine weights folded into the expert MLP), sum_to_tokens (the experts
    also add each row into its token and return y_TD; combine has nothing left to do) and
    all_rows_kept (no dropped tail: the received rows of EP). ctx.gather_ids_R etc. read them.
    algorithm: the all-to-all algorithm that moved the rows between ranks ("flat" or
    "hierarchical", what "auto" chose), None on one device; the layer's stats report it.
    kernel: the experts' kernel (Dispatcher.run sets it from `experts.kernel`), whose combine
    sums the rows the experts return; None: the torch combine.
    """

    plan: RowMap
    rows: ExpertRows = NO_ROWS_INFO
    algorithm: str | None = None
    kernel: ExpertKernel | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rows, ExpertRows):  # the fields before issue 33, positionally
            raise TypeError(
                f"DispatchContext.rows must be an ExpertRows, got {type(self.rows).__name__} "
                "(gather_ids_R, row_weights_R, sum_to_tokens, all_rows_kept are ExpertRows fields)"
            )

    def expert_rows(self) -> ExpertRows:
        """What the experts read (GroupedExperts' `rows`): ctx.rows."""
        return self.rows

    @property
    def gather_ids_R(self) -> torch.Tensor | None:
        return self.rows.gather_ids_R

    @property
    def row_weights_R(self) -> torch.Tensor | None:
        return self.rows.row_weights_R

    @property
    def sum_to_tokens(self) -> bool:
        return self.rows.sum_to_tokens

    @property
    def all_rows_kept(self) -> bool:
        return self.rows.all_rows_kept


class Dispatcher(ABC):
    """Moves rows between token order and expert order (and between ranks).

    Declared capabilities (class attributes, read by parallelize's checks):
    `overlaps`: the constructor takes `degree=` (parallelize's overlap=);
    `takes_wire`: the constructor takes the layer's row wire (`wire=`, moe.dispatch.wire) and sends
    the rows in it (without it, a layer whose rows travel in another format is refused).
    `ranks_per_node`: the ranks per node the exchange uses, resolved (expert-parallel
    dispatchers; None: one node).
    Where this rank sits among the expert slots is the dispatcher's to say, fixed when it is
    built (parallelize), never worked out per forward: `copy_candidates`, which the replica
    split asks for spare slots' copies.
    """

    overlaps: bool = False
    takes_wire: bool = False
    ranks_per_node: int | None = None

    def copy_candidates(self, expert_of_slot_S: torch.Tensor, num_experts: int) -> Candidates:
        """Which copies of each expert this rank sends its pairs to (moe.dispatch.replica_split
        .copy_candidates). The default: every slot on this rank, all of an expert's copies;
        a dispatcher spreading slots over ranks prefers the sender's own, then its node's."""
        return local_candidates(expert_of_slot_S, num_experts)

    @abstractmethod
    def dispatch(
        self, x_TD: torch.Tensor, plan: RowMap
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchContext]:
        """-> (x_ND, offsets_L, ctx): the R rows of this rank's L experts in expert-major
        order (or x_TD itself with ctx.gather_ids_R), int32 cumulative row ends per local
        expert (rows past offsets_L[-1] must come out zero), and the context combine needs."""

    @abstractmethod
    def combine(self, out_ND: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """Expert outputs (out_RD, or y_TD with ctx.sum_to_tokens) -> y_TD, each token the
        weighted sum of its experts' outputs."""

    def run(
        self,
        x_TD: torch.Tensor,
        plan: RowMap,
        experts: ExpertFn | Callable[..., torch.Tensor],
        shared: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (y_TD, shared output or None): dispatch, experts, combine, then `shared()` (the
        layer's dense work on every token). Overridden by strategies that overlap them."""
        experts = rows_only(experts)
        x_ND, offsets_L, ctx = self.dispatch(x_TD, plan)
        ctx.kernel = experts.kernel
        y_TD = self.combine(experts(x_ND, offsets_L, ctx), ctx)
        return y_TD, None if shared is None else shared()
