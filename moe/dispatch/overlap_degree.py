"""How many chunks the overlapped dispatcher pipelines under overlap="auto": the cost-model
choice (the `overlap=` check is moe/dispatch/overlap_option.py, the clocks that measure the
experts and the forward are moe/dispatch/overlap_clock.py)."""

from __future__ import annotations

from moe.comm.cost_model import CostModel

MAX_DEGREE = 8
CHUNK_OVERHEAD_S = 1e-4  # host cost of one more chunk per pass (launches, small ops), assumed


def pipelined_time(x: float, e: float, n: int) -> float:
    """Seconds of one pass with n chunks: send chunk 1, compute, return the last chunk, and
    in between the slower of the link (a chunk out and one back) and the experts (one chunk).
    x: one chunk's one-way exchange; e: one chunk's compute. n = 1 is plain: 2x + e."""
    return 2 * x + e + (n - 1) * max(2 * x, e)


def choose_degree(
    model: CostModel | None,
    max_bytes: int,
    num_nodes: int,
    ranks_per_node: int,
    expert_seconds: float,
    max_degree: int,
    hierarchical: bool = False,
) -> int:
    """The degree with the least predicted forward + backward time (backward compute = 2x
    forward), 1 without a cost model or an expert measurement. Only a proposal: the dispatcher
    keeps it while the layer is measured faster pipelined (OverlappedDispatcher._verified), so
    no threshold on the predicted gain is needed; and the link model (t = a + b * S per
    exchange) misses that exchanges in flight together move data faster than one (the
    emulated 100 Mbit/s link, bench/results/2026-11-25-cpu-overlap-one-call.md), so it
    underestimates the gain. A pure function of values every rank shares: all ranks agree.

    max_bytes: the largest per-rank send buffer; expert_seconds: forward expert time of one
    rank's rows (measured)."""
    if model is None or expert_seconds <= 0 or max_degree < 2:
        return 1
    N, L = num_nodes, ranks_per_node

    def exchange(n: int) -> float:
        S = max_bytes / n
        return model.hier_time(S, N, L) if hierarchical else model.flat_time(S, N, L)

    def total(n: int) -> float:
        x, over = exchange(n), CHUNK_OVERHEAD_S * (n - 1)
        fwd = pipelined_time(x, expert_seconds / n, n)
        bwd = pipelined_time(x, 2 * expert_seconds / n, n)
        return fwd + bwd + 2 * over

    return min(range(1, max_degree + 1), key=total)  # ties: the smaller degree
