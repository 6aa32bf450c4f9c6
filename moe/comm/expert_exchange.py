"""An exchange from counts: ONE count collective per exchange, then its AllToAllSplits.

`exchange_expert_counts` is what the expert-parallel dispatchers call (counts per rank and local
expert, both ways, and the resolved algorithm); `all_to_all_splits` is its one-expert-per-rank
case and `all_to_all` the one-call form (split sizes + exchange). The exchange's mechanics (flat and
hierarchical rows, autograd) are in moe/comm/alltoall.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from moe.comm.alltoall import (
    ALGORITHMS,
    AllToAllSplits,
    Counts,
    choose_algorithm,
    exchange,
    exchange_counts,
    gather_count_matrix,
    hierarchical_threshold,
    pipeline_chunks,
    validate_inputs,
)
from moe.comm.consistency import CrossRankError, describe_mismatch
from moe.comm.exchange_config import ExchangeConfig
from moe.comm.topology import Topology, get_subgroups, get_topology


@dataclass(frozen=True, eq=False)
class ExpertExchange:
    """The counts of one expert-parallel exchange, both ways, from ONE count collective
    (`exchange_expert_counts`), with the algorithm it resolved to; `splits(first, last)` gives the
    AllToAllSplits of the rows of local experts [first, last) without another collective.

    Host lists (every split size the exchange needs is already read): send_WL[d][l] rows this
    rank sends to rank d for its local expert l, recv_WL[s][l] rows it receives from rank s for
    its own local expert l, extras_W[s] the extra columns rank s sent (the same to every rank),
    totals_W[s] the rows rank s sends in all; counts_WWL[s][d][l] the whole matrix, present only
    when the exchange is hierarchical (its intra-node relays need other ranks' counts).
    """

    algorithm: str  # resolved: "flat" or "hierarchical"
    group: dist.ProcessGroup | None
    row_bytes: int
    send_WL: tuple[tuple[int, ...], ...]
    recv_WL: tuple[tuple[int, ...], ...]
    recv_counts_WL: torch.Tensor = field(repr=False)  # recv_WL as a long tensor on the device
    send_counts_WL: torch.Tensor = field(repr=False)  # send_WL as a long tensor on the device
    extras_W: tuple[tuple[int, ...], ...] = ()
    totals_W: tuple[int, ...] = ()
    counts_WWL: tuple[tuple[tuple[int, ...], ...], ...] | None = field(default=None, repr=False)
    topo: Topology | None = None
    exchange_config: ExchangeConfig | None = None  # the settings its plans' pipeline depth follows

    @property
    def max_rank_bytes(self) -> int:
        """The largest send buffer of any rank (bytes): the same number on every rank."""
        return max(self.totals_W, default=0) * self.row_bytes

    def splits(self, first: int = 0, last: int | None = None) -> AllToAllSplits:
        """Split sizes of the rows of local experts [first, last) (default: all), grouped by
        destination rank; the hierarchical pipeline depth follows that chunk's size."""
        last = len(self.recv_WL[0]) if last is None else last
        send = tuple(sum(r[first:last]) for r in self.send_WL)
        recv = tuple(sum(r[first:last]) for r in self.recv_WL)
        recv_t = self.recv_counts_WL[:, first:last].sum(1)
        send_t = self.send_counts_WL[:, first:last].sum(1)
        if self.algorithm == "flat":
            return AllToAllSplits("flat", self.group, send, recv, recv_t, send_counts_W=send_t)
        assert self.topo is not None and self.counts_WWL is not None
        C = tuple(tuple(sum(c_L[first:last]) for c_L in row) for row in self.counts_WWL)
        max_bytes = max(sum(r) for r in C) * self.row_bytes
        chunks = pipeline_chunks(max_bytes, self.topo.num_nodes, self.exchange_config)
        topo = self.topo
        return AllToAllSplits(
            "hierarchical", self.group, send, recv, recv_t, C, topo, chunks, send_t
        )


def exchange_expert_counts(
    counts_WL: torch.Tensor,
    row_bytes: int,
    group: dist.ProcessGroup | None = None,
    algorithm: str = "flat",
    ranks_per_node: int | None = None,
    extra: torch.Tensor | None = None,
    exchange_config: ExchangeConfig | None = None,
) -> ExpertExchange:
    """Exchange the per-(rank, local expert) row counts with ONE collective and resolve the
    algorithm: everything an expert-parallel dispatcher needs to move its rows both ways.

    counts_WL[d, l]: rows this rank sends to local expert l of rank d; row_bytes: bytes of one
    row (for "auto" and the hierarchical pipeline depth); extra: an optional 1-D integer vector
    sent to every rank along with the counts (ExpertExchange.extras_W); exchange_config: the
    settings (moe.comm.ExchangeConfig; None: the defaults). Every rank must call it.

    What each algorithm needs, and so which collective runs:
      * flat (also "hierarchical"/"auto" on one node): each rank's own column, recv_WL[s][l] =
        counts_WL of rank s at [this rank, l] -> one all_to_all_single of W x (L + extras)
        integers;
      * hierarchical, and "auto" on more than one node: the intra-node relays of the 2D exchange
        use node-mates' counts to this rank's local index (forward) and the counts of the ranks
        of equal local index to this rank's node-mates (its reverse), and "auto" needs every
        rank's total to agree on the choice -> one all_gather of the W x (L + extras) rows, so
        every rank holds the W x W x L matrix. "auto" sends its threshold (cost model) along:
        ranks whose thresholds differ, or whose cost model failed, raise the same
        CrossRankError on every rank instead of choosing different exchanges. (The collective
        cannot depend on the threshold, which may differ: "auto" gathers even when it is 0.)
    One host read of the result in either case.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    W = dist.get_world_size(group)
    if counts_WL.dim() != 2 or counts_WL.shape[0] != W:
        raise ValueError(f"counts_WL must be [{W}, local experts], got {tuple(counts_WL.shape)}")
    counts_WL = counts_WL.to(torch.long)
    extra_X = counts_WL.new_zeros(0) if extra is None else extra.to(counts_WL).reshape(-1)
    total = counts_WL.sum().reshape(1)
    topo = None if algorithm == "flat" else get_topology(group, ranks_per_node, exchange_config)
    matrix = topo is not None and topo.is_multi_node
    auto = matrix and algorithm == "auto"
    threshold, problem = _auto_threshold(topo, group, exchange_config) if auto else (0, None)
    own_X = torch.cat([total, extra_X, total.new_tensor([threshold] if auto else [])])
    send_WX = torch.cat([counts_WL, own_X.expand(W, len(own_X))], 1)
    if not matrix:
        return _flat_exchange(send_WX, counts_WL, group, row_bytes, exchange_config)
    assert topo is not None
    return _matrix_exchange(
        send_WX, counts_WL, group, topo, algorithm, (threshold, problem), row_bytes, exchange_config
    )


def _auto_threshold(
    topo: Topology, group: dist.ProcessGroup | None, exchange_config: ExchangeConfig | None
) -> tuple[int, ValueError | None]:
    """The local "auto" threshold (bytes) and the cost model's error, if any: read here,
    compared on every rank after the one count collective (_check_thresholds)."""
    try:
        backend = dist.get_backend(group)
        return max(0, hierarchical_threshold(topo, backend, exchange_config)), None
    except ValueError as e:  # an unreadable cost profile: the other ranks must hear of it
        return _UNREADABLE, e


def _flat_exchange(
    send_WX: torch.Tensor,
    counts_WL: torch.Tensor,
    group: dist.ProcessGroup | None,
    row_bytes: int,
    exchange_config: ExchangeConfig | None,
) -> ExpertExchange:
    """The flat case: one all_to_all_single of each rank's column (counts, total, extras)."""
    W, L = counts_WL.shape
    recv_WX = exchange_counts(send_WX.reshape(-1), group).view(W, -1)
    host = torch.cat([send_WX, recv_WX]).tolist()
    send_h, recv_h = host[:W], host[W:]
    recv_WL = tuple(tuple(r[:L]) for r in recv_h)
    totals = tuple(r[L] for r in recv_h)
    return ExpertExchange(
        "flat",
        group,
        row_bytes,
        tuple(tuple(r[:L]) for r in send_h),
        recv_WL,
        recv_WX[:, :L],
        counts_WL,
        tuple(tuple(r[L + 1 :]) for r in recv_h),
        totals,
        exchange_config=exchange_config,
    )


def _matrix_exchange(
    send_WX: torch.Tensor,
    counts_WL: torch.Tensor,
    group: dist.ProcessGroup | None,
    topo: Topology,
    algorithm: str,
    auto_threshold: tuple[int, ValueError | None],
    row_bytes: int,
    exchange_config: ExchangeConfig | None,
) -> ExpertExchange:
    """More than one node: one all_gather of every rank's rows (the W x W x L matrix), the
    "auto" thresholds checked and the algorithm chosen from it."""
    W, L = counts_WL.shape
    threshold, problem = auto_threshold
    matrix_WWX = gather_count_matrix(send_WX.reshape(-1), group).view(W, W, -1)
    me = topo.rank
    host = matrix_WWX.tolist()
    if algorithm == "auto":
        _check_thresholds([row[0].pop() for row in host], problem)
    counts = tuple(tuple(tuple(c[:L]) for c in row) for row in host)
    totals = tuple(row[0][L] for row in host)
    chosen = algorithm
    if algorithm == "auto":
        chosen = choose_algorithm(topo, max(totals) * row_bytes, threshold)
    if chosen == "hierarchical":
        get_subgroups(topo, group)  # create (once, cached) before the first exchange
    return ExpertExchange(
        chosen,
        group,
        row_bytes,
        counts[me],
        tuple(row[me] for row in counts),
        matrix_WWX[:, me, :L],
        counts_WL,
        tuple(tuple(row[0][L + 1 :]) for row in host),
        totals,
        counts if chosen == "hierarchical" else None,
        topo if chosen == "hierarchical" else None,
        exchange_config,
    )


_UNREADABLE = -1  # sent in place of the "auto" threshold by a rank whose cost model failed


def _check_thresholds(thresholds_W: list[int], problem: ValueError | None) -> None:
    """The "auto" thresholds every rank sent with its counts must agree, or ranks would choose
    different exchanges and wait in different collectives: the same CrossRankError on every
    rank (the local cost model's error, if any, as its cause)."""
    if len(set(thresholds_W)) == 1 and thresholds_W[0] != _UNREADABLE:
        return
    shown = [
        {"the hierarchical threshold": "unreadable" if t == _UNREADABLE else f"{t} bytes"}
        for t in thresholds_W
    ]
    message = describe_mismatch(shown) or (
        f"the hierarchical threshold is unreadable on every rank (here: {problem})"
    )
    raise CrossRankError(
        f'algorithm="auto": {message}. Every rank must use the same cost model '
        "(ExchangeConfig.cost_model / cost_profile, MOE_A2A_COST_PROFILE) and threshold "
        "(ExchangeConfig.hierarchical_max_bytes, MOE_A2A_HIERARCHICAL_MAX_BYTES); a rank whose "
        "model failed is named 'unreadable'"
    ) from problem


def all_to_all_splits(
    x_ND: torch.Tensor,
    send_counts_W: Counts,
    group: dist.ProcessGroup | None = None,
    algorithm: str = "flat",
    ranks_per_node: int | None = None,
    chunks: int | None = None,
    exchange_config: ExchangeConfig | None = None,
) -> AllToAllSplits:
    """Validate, exchange the counts (one small collective), resolve the algorithm: the
    one-expert-per-rank case of exchange_expert_counts.

    chunks: pipeline depth of the hierarchical path (default: pipeline_chunks()).
    """
    group_size = dist.get_world_size(group)
    send = validate_inputs(x_ND, send_counts_W, group_size)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    send_t = torch.tensor(send, dtype=torch.long, device=x_ND.device).view(group_size, 1)
    row_bytes = x_ND.shape[1] * x_ND.element_size()
    ex = exchange_expert_counts(
        send_t, row_bytes, group, algorithm, ranks_per_node, None, exchange_config
    )
    plan = ex.splits()
    if chunks is None or plan.algorithm == "flat":
        return plan
    return replace(plan, chunks=chunks)


def all_to_all(
    x_ND: torch.Tensor,
    send_counts_W: Counts,
    group: dist.ProcessGroup | None = None,
    algorithm: str = "flat",
    ranks_per_node: int | None = None,
    exchange_config: ExchangeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uneven all-to-all of rows: returns (y_ND, recv_counts_W); autograd-aware.

    x_ND: rows grouped by destination, send_counts_W[i] rows to group rank i (long tensor or
    list of ints). y_ND: rows grouped by source rank in rank order; recv_counts_W[i] = rows
    from rank i (long tensor on x's device). algorithm: "flat" (one all_to_all_single),
    "hierarchical" (2D: intra-node then inter-node; the same y bit for bit) or "auto"
    (per call from the largest per-rank buffer, which every rank knows, and the cost model:
    hierarchical up to hierarchical_threshold(); on gloo only with a profile or threshold;
    the choice is plan.algorithm). ranks_per_node overrides topology detection (see
    moe.comm.topology); exchange_config: the settings (moe.comm.ExchangeConfig). Every rank
    of the group must call it, also with zero rows, and
    must then take part in the backward too. A tensor send_counts_W costs one host read for
    validation, the received counts one more.
    """
    plan = all_to_all_splits(
        x_ND, send_counts_W, group, algorithm, ranks_per_node, None, exchange_config
    )
    return exchange(x_ND, plan), plan.recv_counts_W


# the name before 2026-12-07, kept one release (CHANGELOG): "plan" is the layout planner's
plan_all_to_all = all_to_all_splits
