"""The overlapped dispatcher's clocks: the experts' seconds per row and the layer's forward
times (plain and pipelined), on the host for CPU work and by CUDA events on the GPU."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

RECENT = 4  # "auto" compares the fastest of each option's last RECENT forward times
EXPLORE = 3  # ... once each option has that many (after its first, cold call)


class Stopwatch:
    """Seconds between start(x) and measure(start, record): host time on the CPU (the work is
    synchronous); on CUDA events on the stream, read once complete (query(), no sync), so
    `record(seconds)` runs at a later start() or resolve(), a call or two late. Each clock's
    `stop(start, key)` says what the time was of (its key) and records it."""

    def __init__(self) -> None:
        self._pending: list = []

    def start(self, x: torch.Tensor):
        if not x.is_cuda:
            return time.perf_counter()
        self.resolve()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start, key) -> None:
        raise NotImplementedError

    def measure(self, start, record: Callable[[float], None]) -> None:
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
        """key: the rows the experts computed since `start`."""
        if rows > 0:
            self.measure(start, lambda seconds: self._update(seconds / rows))

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
        """key: whether the forward since `start` was pipelined."""
        self.runs[piped] += 1
        if self.runs[piped] > 1:
            self.measure(start, self._recent[piped].append)

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
