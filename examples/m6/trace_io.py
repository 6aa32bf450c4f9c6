"""The run's routing trace (moe.RoutingTrace), or a stand-in that records nothing (a dense
model). Under --pp one trace per pipeline stage with MoE layers,
`routing_trace.stage-S.jsonl`, its layers under the single-process names (`blocks.1.ffn`),
counts summed over the stage's ranks and written by its first rank (as
moe.pipeline.features.routing_traces does, with the example's names)."""

from __future__ import annotations

import re
from pathlib import Path

import torch.distributed as dist

import moe
from examples.m6.cli import UsageError
from examples.m6.pipe import PipelineRun
from moe.comm.consistency import all_gather_records
from moe.parallel.mesh import mesh_group
from moe.trace.segments import prepare_resume, segments

STAGE_TRACE = "routing_trace.stage-{stage}.jsonl"


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


class _StageTraces:
    """This rank's stages' traces ({stage index: trace}), stepped and closed together (every
    rank of a stage calls them at the same points)."""

    def __init__(self, traces: dict[int, moe.RoutingTrace]):
        self.traces = traces

    def step(self, step: int) -> None:
        for t in self.traces.values():
            t.step(step)

    def flush(self) -> None:
        for t in self.traces.values():
            t.flush()

    def record_rebalance(self, step: int, reports: dict) -> None:
        """{stage index: its RebalanceReport} (examples/m6/pipe.PipelineRun.rebalance)."""
        for s, report in reports.items():
            self.traces[s].record_rebalance(step, report)

    def close(self) -> None:
        for t in self.traces.values():
            t.close()


def stage_traces(run: PipelineRun, folder: Path, every: int, resume_from) -> _StageTraces:
    """One moe.RoutingTrace per local stage with MoE layers (single-process layer names)."""
    from examples.m6.pipe_ckpt import stage_views

    group = mesh_group(run.pipe.mesh["dp", "ep"])
    return _StageTraces(
        {
            s: moe.RoutingTrace(
                view,
                folder / STAGE_TRACE.format(stage=s),
                every=every,
                group=group,
                resume_from=resume_from,
            )
            for s, view in stage_views(run).items()
        }
    )


def stage_trace_files(folder: Path) -> list[Path]:
    """The stage traces of a --pp run in `folder` (routing_trace.stage-S.jsonl), by stage."""
    name = re.compile(re.escape(STAGE_TRACE).replace(r"\{stage\}", r"(\d+)"))
    found = []
    for p in folder.glob(STAGE_TRACE.format(stage="*")):
        m = name.fullmatch(p.name)
        if m and p.is_file() and not p.is_symlink():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def trace_files(folder: Path) -> list[Path]:
    """Every routing-trace file of the run in `folder`: the trace's segments (one per EP
    layout, moe.trace.segments) and a --pp run's stage traces with theirs, so that a run
    resumed with or without --pp draws all its steps (examples/m6/plots.plot_expert_load)."""
    from examples.m6.report import TRACE

    stages = [f for p in stage_trace_files(folder) for f in segments(p)]
    return [*segments(folder / TRACE), *stages]


def _retire_other_kind(model, path: Path, start: int) -> None:
    """Resuming with --pp after a run without it (or the other way): the other kind's traces
    keep their lines up to `start` in segment files of their own (moe.trace.segments) and
    start no new lines; later lines (past the checkpoint) are dropped. World rank 0 writes;
    a damaged file is its ValueError on every rank."""
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        others = [path] if isinstance(model, PipelineRun) else stage_trace_files(path.parent)
        try:
            for other in others:
                prepare_resume(other, start, layout=None)  # no layout continues there
        except (ValueError, OSError) as e:
            problem = str(e)
    if dist.is_initialized():
        records = all_gather_records({"problem": problem})
        problem = next((r["problem"] for r in records if r["problem"] is not None), None)
    if problem is not None:
        raise ValueError(problem)


def open_trace(model, path: Path, args, start: int):
    """The run's routing trace; resuming keeps its lines up to `start` (the other kind's too:
    a --pp run's stage traces, or the trace of a run without --pp). A damaged trace or a
    path that is not a regular file is a UsageError naming it (file:line) on every rank."""
    resume_from = start if args.resume else None  # other layouts' lines: files of their own
    try:
        if resume_from is not None:
            _retire_other_kind(model, path, resume_from)
        if isinstance(model, PipelineRun):
            return stage_traces(model, path.parent, args.log_every, resume_from)
        if not moe.moe_layers(model):
            return _NoTrace()
        return moe.RoutingTrace(model, path, every=args.log_every, resume_from=resume_from)
    except ValueError as e:
        hint = " (remove it to start a new trace)" if args.resume else ""
        raise UsageError(f"{e}{hint}") from None
