"""The run's routing trace (moe.RoutingTrace), or a stand-in that records nothing (a dense
model; --pp, whose stages are not traced yet)."""

from __future__ import annotations

from pathlib import Path

import moe
from examples.m6.cli import UsageError
from examples.m6.pipe import PipelineRun


class _NoTrace:
    """A dense model (--dense, --experts 0) has no expert load to trace."""

    def step(self, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def record_rebalance(self, step: int, report) -> None:
        pass

    def close(self) -> None:
        pass


def open_trace(model, path: Path, args, start: int) -> moe.RoutingTrace | _NoTrace:
    """The run's routing trace; resuming keeps its lines up to `start`. A damaged trace or a
    path that is not a regular file is a UsageError naming it (file:line) on every rank."""
    if isinstance(model, PipelineRun) or not moe.moe_layers(model):  # --pp: no trace yet
        return _NoTrace()
    resume_from = start if args.resume else None  # other layouts' lines: files of their own
    try:
        return moe.RoutingTrace(model, path, every=args.log_every, resume_from=resume_from)
    except ValueError as e:
        hint = " (remove it to start a new trace)" if args.resume else ""
        raise UsageError(f"{e}{hint}") from None
