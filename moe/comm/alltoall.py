"""Autograd-aware uneven all-to-all of token rows: flat, hierarchical (2D) or auto.

Rows of x_ND are grouped by destination rank (send_counts_W[i] rows go to group rank i); the
result holds the received rows grouped by source rank. Counts are exchanged first with ONE
small collective and read on the host once (NCCL and gloo take split sizes as Python lists);
the backward is the reverse exchange with the counts swapped, by the same algorithm, reusing
the counts (no second count exchange).

Hierarchical (N nodes x L ranks, rank r = node n * L + local j): stage 1 re-lays out the rows by
destination local index and runs an all-to-all inside the node, so rank (n, j) holds every row
of its node bound for local index j; stage 2 re-lays those out by destination node and runs an
all-to-all among the N ranks of local index j. Each rank sends N-1 network messages of about
S/N bytes instead of W-L of S/W. Received rows come out in source-rank order, exactly as flat.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe.comm.cost_model import NVLINK_IB, CostModel
from moe.comm.exchange_config import (  # noqa: F401 - the deprecated setters' old path
    ExchangeConfig,
    env_var,
    resolved,
    set_cost_model,
    set_hierarchical_threshold,
    threshold_override,
)
from moe.comm.topology import Topology, get_subgroups

ALGORITHMS = ("flat", "hierarchical", "auto")
ENV_HIERARCHICAL_MAX_BYTES = env_var("hierarchical_max_bytes")
ENV_COST_PROFILE = env_var("cost_profile")
ENV_PIPELINE_MIN_BYTES = env_var("pipeline_min_bytes")
MAX_PIPELINE_CHUNKS = 4

Counts = torch.Tensor | Sequence[int]


def cost_model(
    backend: str = "nccl", exchange_config: ExchangeConfig | None = None
) -> CostModel | None:
    """The model "auto" uses: exchange_config.cost_model (ExchangeConfig.model: given in code,
    else the deprecated set_cost_model's), then the JSON profile exchange_config.cost_profile
    (given in code, else MOE_A2A_COST_PROFILE when the config was built), then NVLINK_IB for
    NCCL. None (always flat) for other backends without a profile: on the emulated two-tier
    gloo network the per-collective overhead outweighed the saved messages at every size
    (bench/results/*alltoall*)."""
    model = resolved(exchange_config).model()  # a profile is read once per config
    if model is not None:
        return model
    return NVLINK_IB if backend == "nccl" else None


def default_hierarchical_threshold(
    topo: Topology, backend: str, exchange_config: ExchangeConfig | None = None
) -> int:
    """Largest per-rank buffer (bytes) for which the 2D path is predicted to win: the cost
    model's crossover (about 5.6 MB at 2 x 8 GPUs on NVLINK_IB, beyond any realistic buffer
    at 60 x 8); 0 without a model or without more than one node."""
    model = cost_model(backend, exchange_config)
    if model is None or not topo.is_multi_node:
        return 0
    return model.crossover_bytes(topo.num_nodes, topo.ranks_per_node)


def hierarchical_threshold(
    topo: Topology | None = None,
    backend: str = "nccl",
    exchange_config: ExchangeConfig | None = None,
) -> int:
    """Current "auto" threshold (bytes per rank): exchange_config.hierarchical_max_bytes (given
    in code, else the deprecated set_hierarchical_threshold's, else
    MOE_A2A_HIERARCHICAL_MAX_BYTES when the config was built), then
    default_hierarchical_threshold."""
    exchange_config = resolved(exchange_config)
    if exchange_config.hierarchical_max_bytes is not None:
        return exchange_config.hierarchical_max_bytes
    return 0 if topo is None else default_hierarchical_threshold(topo, backend, exchange_config)


def pipeline_chunks(
    max_rank_bytes: int, num_nodes: int, exchange_config: ExchangeConfig | None = None
) -> int:
    """Pipeline depth of the 2D path: cut the exchange into chunks only while every network
    message of a chunk (about S / (N * chunks) bytes) stays at least
    exchange_config.pipeline_min_bytes (given in code, else MOE_A2A_PIPELINE_MIN_BYTES when the
    config was built; default 2 MiB, bandwidth-bound), at most 4 chunks. Each chunk costs one
    more pair of collectives, so small buffers and many nodes get 1 chunk; 0 disables it."""
    min_bytes = resolved(exchange_config).pipeline_min_bytes
    if min_bytes <= 0:
        return 1
    return max(1, min(MAX_PIPELINE_CHUNKS, max_rank_bytes // (num_nodes * min_bytes)))


def choose_algorithm(
    topo: Topology,
    max_rank_bytes: int,
    threshold: int | None = None,
    backend: str = "nccl",
    exchange_config: ExchangeConfig | None = None,
) -> str:
    """ "hierarchical" only for more than one node (and >1 rank per node) and buffers up to
    a positive threshold (default: hierarchical_threshold(topo, backend), the cost model's
    crossover); 0 means never."""
    if not topo.is_multi_node:
        return "flat"
    limit = (
        hierarchical_threshold(topo, backend, exchange_config) if threshold is None else threshold
    )
    return "hierarchical" if limit > 0 and max_rank_bytes <= limit else "flat"


def validate_inputs(x_ND: torch.Tensor, send_counts_W: Counts, group_size: int) -> list[int]:
    """Check shapes and counts before any communication; return the counts as host ints."""
    if not isinstance(x_ND, torch.Tensor) or x_ND.dim() != 2:
        shape = tuple(x_ND.shape) if isinstance(x_ND, torch.Tensor) else type(x_ND).__name__
        raise ValueError(f"x_ND must be a 2D tensor [rows, d], got {shape}")
    if isinstance(send_counts_W, torch.Tensor):
        if send_counts_W.dim() != 1:
            raise ValueError(f"send_counts_W must be 1D, got shape {tuple(send_counts_W.shape)}")
        if send_counts_W.is_floating_point() or send_counts_W.is_complex():
            raise ValueError(f"send_counts_W must be integer, got dtype {send_counts_W.dtype}")
        counts = [int(c) for c in send_counts_W.tolist()]  # the one host read of the send side
    else:
        try:
            counts = [int(c) for c in send_counts_W]
        except (TypeError, ValueError):
            raise ValueError("send_counts_W must be a tensor or a sequence of ints") from None
    if len(counts) != group_size:
        raise ValueError(
            f"send_counts_W has {len(counts)} entries but the group has {group_size} ranks"
        )
    negative = [i for i, c in enumerate(counts) if c < 0]
    if negative:
        raise ValueError(f"send_counts_W has negative entries at ranks {negative}: {counts}")
    if sum(counts) != x_ND.shape[0]:
        raise ValueError(f"send_counts_W sums to {sum(counts)} but x_ND has {x_ND.shape[0]} rows")
    return counts


def alone(group: dist.ProcessGroup | None) -> bool:
    """A group of this rank only (ep = 1): its exchanges are copies, made here without a
    collective (on gloo each one is a hand-off to the group's worker thread and back, per layer
    and micro-batch: 0.1-1.2 ms each on a loaded 2-core CPU)."""
    return dist.get_world_size(group) == 1


def exchange_counts(send_counts_W: torch.Tensor, group: dist.ProcessGroup | None = None):
    """Flat count exchange: recv_counts_W[i] = rows rank i sends here (one all_to_all_single)."""
    send = send_counts_W.to(torch.long).contiguous()
    if alone(group):
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def gather_count_matrix(send_counts_W: torch.Tensor, group: dist.ProcessGroup | None = None):
    """counts_WW[s, d] = rows rank s sends to rank d, on every rank (one all_gather)."""
    send = send_counts_W.to(torch.long).contiguous()
    rows = [torch.empty_like(send) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, send, group=group)
    return torch.stack(rows)


def _all_to_all_rows(x_ND, send: list[int], recv: list[int], group) -> torch.Tensor:
    """One uneven all_to_all_single of rows."""
    if alone(group):
        return x_ND.clone(memory_format=torch.contiguous_format)
    y_ND = x_ND.new_empty((sum(recv), x_ND.shape[1]))
    dist.all_to_all_single(
        y_ND, x_ND.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group
    )
    return y_ND


_scratch = threading.local()


def _scratch_rows(slot: tuple, rows: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [rows, d] buffer for an intermediate of the 2D exchange.

    CUDA: torch.empty (the caching allocator already reuses memory). CPU: a grow-only buffer
    per slot, dtype and thread, because freshly mapped pages dominate CPU copy time (on the
    2-core benchmark VM a fresh 16 MiB buffer costs ~7x a reused one). Slots are distinct for
    every intermediate that is alive at the same time within one call.
    """
    shape = (rows, like.shape[1])
    if like.device.type != "cpu":
        return like.new_empty(shape)
    pool = _scratch.__dict__.setdefault("pool", {})
    key = (slot, like.dtype)
    numel = rows * like.shape[1]
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        buf = pool[key] = torch.empty(numel, dtype=like.dtype)
    return buf[:numel].view(shape)


def _relayout(x_ND: torch.Tensor, sizes: list[int], order: list[int], slot: tuple) -> torch.Tensor:
    """Reorder contiguous row blocks of the given sizes into the given block order."""
    blocks = torch.split(x_ND, sizes)
    out = _scratch_rows(slot, x_ND.shape[0], x_ND)
    return torch.cat([blocks[b] for b in order], out=out)


@dataclass(frozen=True, eq=False)
class AllToAllSplits:
    """Split sizes of one exchange, resolved on the host; reusable, reversible, no collectives.

    ``reverse()`` is the plan for sending the received rows back (counts swapped, same
    algorithm): the MoE layer can use it for the combine-side exchange without a second count
    exchange.
    """

    algorithm: str  # resolved: "flat" or "hierarchical"
    group: dist.ProcessGroup | None
    send: tuple[int, ...]  # rows to each group rank
    recv: tuple[int, ...]  # rows from each group rank
    recv_counts_W: torch.Tensor = field(repr=False)  # recv as a long tensor on x's device
    counts_WW: tuple[tuple[int, ...], ...] | None = None  # hierarchical only: [src][dst]
    topo: Topology | None = None  # hierarchical only
    chunks: int = 1  # hierarchical only: pipeline depth (see pipeline_chunks)
    # send as a long tensor on the device when the planner has it (reverse() then needs no
    # host-to-device copy, which on CUDA would wait for the stream: a host sync)
    send_counts_W: torch.Tensor | None = field(default=None, repr=False)

    def reverse(self) -> AllToAllSplits:
        send_t = self.send_counts_W
        if send_t is None:
            send_t = torch.tensor(self.send, dtype=torch.long, device=self.recv_counts_W.device)
        counts_WW = None if self.counts_WW is None else tuple(zip(*self.counts_WW))
        return AllToAllSplits(
            self.algorithm,
            self.group,
            self.recv,
            self.send,
            send_t,
            counts_WW,
            self.topo,
            self.chunks,
            self.recv_counts_W,
        )

    def run(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The exchange itself (no autograd); every rank of the group must call it."""
        if x_ND.dim() != 2 or x_ND.shape[0] != sum(self.send):
            raise ValueError(f"x_ND must be [{sum(self.send)}, d], got {tuple(x_ND.shape)}")
        if self.algorithm == "flat":
            return _all_to_all_rows(x_ND, list(self.send), list(self.recv), self.group)
        return self._run_hierarchical(x_ND)

    def _run_hierarchical(self, x_ND: torch.Tensor) -> torch.Tensor:
        assert self.topo is not None and self.counts_WW is not None
        intra, inter = get_subgroups(self.topo, self.group)
        return _hierarchical_rows(x_ND, self.counts_WW, self.topo, intra, inter, self.chunks)


def _part(n: int, k: int, K: int) -> int:
    """Rows in chunk k when n rows are cut into K consecutive, nearly equal chunks."""
    return n * (k + 1) // K - n * k // K


def _hierarchical_rows(x_ND, C, topo: Topology, intra, inter, K: int) -> torch.Tensor:
    """2D exchange of rows by counts C[src][dst], pipelined over K chunks of every block.

    Chunk k holds the k-th slice of every (source, destination) block, so each chunk is itself
    a valid exchange; the intra-node stage of chunk k+1 runs while chunk k crosses the network
    (separate process groups), and the chunks are interleaved back into source order at the end.
    """
    L, N, n, j, r = topo.ranks_per_node, topo.num_nodes, topo.node, topo.local_rank, topo.rank
    W, D = L * N, x_ND.shape[1]
    row, col = C[r], [C[s][r] for s in range(W)]
    mates = [[C[n * L + l][m * L + j] for m in range(N)] for l in range(L)]  # node-mate l -> (m, j)
    x_blocks = torch.split(x_ND, [_part(row[d], k, K) for d in range(W) for k in range(K)])
    stage1 = []
    for k in range(K):
        # Stage 1: destination blocks (m, l) -> order (l, m); local index l goes to node-mate l.
        x1 = _scratch_rows(("x1", k), sum(_part(c, k, K) for c in row), x_ND)
        torch.cat([x_blocks[(m * L + l) * K + k] for l in range(L) for m in range(N)], out=x1)
        send1 = [sum(_part(row[m * L + l], k, K) for m in range(N)) for l in range(L)]
        got1 = [_part(mates[l][m], k, K) for l in range(L) for m in range(N)]
        recv1 = [sum(got1[l * N : (l + 1) * N]) for l in range(L)]
        y1 = _scratch_rows(("y1", k), sum(recv1), x_ND)
        work = dist.all_to_all_single(y1, x1, recv1, send1, group=intra, async_op=True)
        stage1.append((work, y1, x1, got1))
    stage2 = []
    for k, (work, y1, _x1, got1) in enumerate(stage1):
        work.wait()
        # Stage 2: received blocks (l, m) -> order (m, l); node m's rows go to (m, j).
        x2 = _relayout(y1, got1, [l * N + m for m in range(N) for l in range(L)], ("x2", k))
        send2 = [sum(got1[l * N + m] for l in range(L)) for m in range(N)]
        recv2 = [sum(_part(col[m * L + l], k, K) for l in range(L)) for m in range(N)]
        y2 = (
            x_ND.new_empty((sum(recv2), D))
            if K == 1
            else _scratch_rows(("y2", k), sum(recv2), x_ND)
        )
        work2 = dist.all_to_all_single(y2, x2, recv2, send2, group=inter, async_op=True)
        stage2.append((work2, y2, x2))
    for work2, _y2, _x2 in stage2:
        work2.wait()
    if K == 1:
        return stage2[0][1]
    y_blocks = [
        torch.split(y2, [_part(col[s], k, K) for s in range(W)])
        for k, (_, y2, _) in enumerate(stage2)
    ]
    return torch.cat([y_blocks[k][s] for s in range(W) for k in range(K)])


class _Exchange(torch.autograd.Function):
    """y = plan.run(x); grad_x = plan.reverse().run(grad_y), itself differentiable."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, plan: AllToAllSplits) -> torch.Tensor:
        ctx.plan = plan
        return plan.run(x_ND)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        return _Exchange.apply(grad_ND.contiguous(), ctx.plan.reverse()), None


def exchange(x_ND: torch.Tensor, plan: AllToAllSplits) -> torch.Tensor:
    """Autograd-aware exchange of rows by a precomputed plan (no count exchange)."""
    return _Exchange.apply(x_ND, plan)


# the name before 2026-12-07, kept one release (CHANGELOG): "plan" is the layout planner's
AllToAllPlan = AllToAllSplits
