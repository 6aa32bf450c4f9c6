"""The dispatcher seam: how token rows reach the experts that compute them and come back.

A dispatcher owns the path between the routing plan and the experts, and back:

    x_RD, offsets_L, ctx = dispatcher.dispatch(x_TD, plan)   # rows of this rank's experts
    out_RD = experts(x_RD, offsets_L, ctx)  # an ExpertFn: the layer's LayerExperts
    y_TD = dispatcher.combine(out_RD, ctx)  # weighted sum back to tokens (if not done above)

(With ctx.gather_ids_R set, the local dispatcher's "x_RD" is the token matrix x_TD and the
experts gather on load; with ctx.sum_to_tokens their "out_RD" is y_TD.) The experts declare
whether they can take the combine over (`experts.fuses_combine`); a dispatcher asks them
rather than guessing from a backend.

MoELayer calls `dispatcher.run(x_TD, plan, experts, shared, backend=...)`, whose default is
exactly the three lines above (then the shared experts). A new strategy (another all-to-all, a
node-aware exchange) is one subclass plus `@register_dispatcher("name")`; `parallelize` or a
user installs it as `MoELayer.dispatcher`. A strategy that interleaves exchange and compute
(the overlapped dispatcher) overrides `run` instead and calls the experts in parts
(`ExpertFn.call_once` and `ExpertFn.part`). Every rank of a distributed dispatcher must call
dispatch and combine (or run) once per forward, also with zero tokens, so collectives match.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe.dispatch.permute import DispatchPlan
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows

DISPATCHERS: dict[str, type["Dispatcher"]] = {}


class ExpertFn(ABC):
    """The layer's experts as every dispatcher calls them (moe.experts.LayerExperts for a
    layer; `rows_only` wraps a plain function of the rows).

    `experts(x_RD, offsets_L, ctx)` computes all L local experts on their rows (expert-major,
    int32 row ends offsets_L) with ctx.expert_rows() (gather on load, combine weights, sum into
    tokens). A dispatcher that calls the experts in parts (moe.dispatch.overlapped) runs
    `call_once(x, compute)`: compute(x, weights) inside one call of the experts module, so
    FSDP2 gathers and reduces the weights once, weights being the local expert tensors (w1, w2,
    w3, b1, b2); compute then calls `part(x_RD, offsets_L, ctx, weights, first)` for each part:
    weights are slices [first:first + n] of those tensors (or leaves made from them), the rows
    belong to local experts in that range and offsets_L still covers all L experts.
    """

    @property
    def fuses_combine(self) -> bool:
        """Whether the experts apply the combine themselves (gather on load, row weights, sum
        into tokens: the ExpertRows contract of moe.kernels.expert_mlp)."""
        return False

    @abstractmethod
    def __call__(
        self, x_RD: torch.Tensor, offsets_L: torch.Tensor, ctx: "DispatchContext"
    ) -> torch.Tensor:
        """All L local experts on their rows -> out_RD (or y_TD with ctx.sum_to_tokens)."""

    def call_once(self, x: torch.Tensor, compute: Callable) -> torch.Tensor:
        """compute(x, weights) within one call of the experts module (no weights: ())."""
        return compute(x, ())

    def part(
        self,
        x_RD: torch.Tensor,
        offsets_L: torch.Tensor,
        ctx: "DispatchContext",
        weights: tuple,
        first: int,
    ) -> torch.Tensor:
        """The local experts [first, first + len(weights[0])) with `weights` (from
        call_once); without weights, all of them on these rows."""
        return self(x_RD, offsets_L, ctx)


@dataclass(frozen=True)
class _RowsOnly(ExpertFn):
    """A plain function (x_RD, offsets_L, ctx) -> out_RD as an ExpertFn (no weights of its
    own to hand over, no fused combine)."""

    fn: Callable[..., torch.Tensor]

    def __call__(self, x_RD, offsets_L, ctx):
        return self.fn(x_RD, offsets_L, ctx)


def rows_only(experts: "ExpertFn | Callable[..., torch.Tensor]") -> ExpertFn:
    """`experts` as an ExpertFn: itself, or a plain function of (x_RD, offsets_L, ctx)."""
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
    backend: the kernel backend resolved once per layer call (Dispatcher.run sets it); the
    combine's kernels use it. None: the dispatcher resolves its own setting.
    """

    plan: DispatchPlan
    rows: ExpertRows = NO_ROWS_INFO
    algorithm: str | None = None
    backend: str | None = None

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

    `ranks_per_node`: the exchange's ranks per node when set (expert-parallel dispatchers;
    None: one node, or detected by the exchange); replicas prefer a copy on the sender's node.
    """

    ranks_per_node: int | None = None

    @abstractmethod
    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchContext]:
        """-> (x_RD, offsets_L, ctx): the R rows of this rank's L experts in expert-major
        order, int32 cumulative row ends per local expert (rows past offsets_L[-1] must come
        out zero), and the context combine needs."""

    @abstractmethod
    def combine(self, out_RD: torch.Tensor, ctx: DispatchContext) -> torch.Tensor:
        """Expert outputs -> y_TD, each token the weighted sum of its experts' outputs."""

    def run(
        self,
        x_TD: torch.Tensor,
        plan: DispatchPlan,
        experts: ExpertFn | Callable[..., torch.Tensor],
        shared: Callable[[], torch.Tensor] | None = None,
        *,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (y_TD, shared output or None): dispatch, experts, combine, then `shared()` (the
        layer's dense work on every token). Overridden by strategies that overlap them.
        backend: the kernel backend the layer resolved for this call (ctx.backend: the
        combine's kernels use it); None: the dispatcher's own choice."""
        x_RD, offsets_L, ctx = self.dispatch(x_TD, plan)
        ctx.backend = backend
        y_TD = self.combine(rows_only(experts)(x_RD, offsets_L, ctx), ctx)
        return y_TD, None if shared is None else shared()
