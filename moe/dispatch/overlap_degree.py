"""How many chunks the overlapped dispatcher pipelines: the `overlap=` argument, its check
across ranks, the expert clock, and the cost-model choice behind overlap="auto"."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from moe.comm.cost_model import CostModel

MAX_DEGREE = 8
RECENT = 4  # "auto" compares the fastest of each option's last RECENT forward times
EXPLORE = 3  # ... once each option has that many (after its first, cold call)
CHUNK_OVERHEAD_S = 1e-4  # host cost of one more chunk per pass (launches, small ops), assumed


def validate_overlap(overlap: int | str | None) -> int | str | None:
    """None (plain dispatcher), an int >= 1 (the degree) or "auto"; ValueError otherwise."""
    if overlap is None or overlap == "auto":
        return overlap
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 1:
        raise ValueError(f"overlap must be None, an int >= 1 or 'auto', got {overlap!r}")
    return overlap


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


class Stopwatch:
    """Seconds between start(x) and stop(start, record): host time on the CPU (the work is
    synchronous); on CUDA events on the stream, read once complete (query(), no sync), so
    `record(seconds)` runs at a later start() or resolve(), a call or two late."""

    def __init__(self) -> None:
        self._pending: list = []

    def start(self, x: torch.Tensor):
        if not x.is_cuda:
            return time.perf_counter()
        self.resolve()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start, record: Callable[[float], None]) -> None:
        if isinstance(start, float):
            record(time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((start, end, record))

    def resolve(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end, record = self._pending.pop(0)
            record(start.elapsed_time(end) / 1e3)


class ExpertClock(Stopwatch):
    """Forward expert seconds per row on this rank (running mean of recent calls)."""

    def __init__(self, decay: float = 0.5) -> None:
        super().__init__()
        self.decay = decay
        self.seconds_per_row = 0.0

    def stop(self, start, rows: int) -> None:
        if rows > 0:
            super().stop(start, lambda seconds: self._update(seconds / rows))

    def _update(self, rate: float) -> None:
        old = self.seconds_per_row
        self.seconds_per_row = rate if old == 0 else self.decay * old + (1 - self.decay) * rate


class ForwardTimes(Stopwatch):
    """This layer's recent forward times, plain (False) and pipelined (True), for "auto": the
    fastest of the last RECENT calls of each (one slow call, another process on the core, does
    not flip the choice; a lasting change does). Each option's first call is not kept: its
    first-call allocations and setup would make it look slower than it is."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = {False: 0, True: 0}  # calls of each option, identical on every rank
        self._recent = {False: deque(maxlen=RECENT), True: deque(maxlen=RECENT)}

    def stop(self, start, piped: bool) -> None:
        self.runs[piped] += 1
        if self.runs[piped] > 1:
            super().stop(start, self._recent[piped].append)

    def fastest(self, piped: bool) -> float:
        """Seconds (0.0: none measured yet)."""
        self.resolve()
        return min(self._recent[piped], default=0.0)

    def exploring(self) -> bool:
        """Too few calls of either option to compare them yet."""
        return min(self.runs.values()) < EXPLORE + 1

    def next_to_explore(self) -> bool:
        """While exploring, the options alternate: the one run less often goes next."""
        return self.runs[True] < self.runs[False]
