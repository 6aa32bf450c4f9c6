"""A failure inside a pipeline step is one named error on every rank, in bounded time, while the
schedule runs on the thread that calls Pipeline.step (thread-local state around step() - grad
mode, autocast, saved_tensors_hooks, dispatch modes, profilers, streams - reaches the stages).

What is used (PyTorch 2.13; what it assumes beyond torch's documented API is in
moe.pipeline.torch_internals), confined to the pipeline's own process groups:

- every group a step communicates over is the pipeline's own (moe.pipeline.groups: an
  agreement group over every rank, the P2P groups, the stages' dp / ep / dp x ep groups),
  created with step_timeout, so every wait of a step is bounded by it. No other process group
  of the process is touched.
- a rank whose part fails (an exception, the router's NaN check, a transfer that failed or
  timed out) appends a report (rank, stage, the original exception's type and message) to the
  agreement group's store, closes the pipeline's groups (NCCL: abort; gloo: their connections
  shut down, so the peers waiting on it wake at once) and raises PipelineStepError naming
  every report it reads.
- a watcher thread (moe.pipeline.watch) reads the reports during a step; on another rank's
  report it closes the pipeline's groups here too (a blocked wait on them ends at once) and
  interrupts the calling thread (running Python code, it stops at its next bytecode), which
  raises the same PipelineStepError. Where gloo's connections could not be recorded, a gloo
  wait ends at its timeout, step_timeout.
- the step ends with a barrier over every rank (the agreement group), so a rank that finished
  its part still learns of a failure later in the step. The check of the step's inputs and, at
  the first step, the search for the stage shapes are watched the same way: a rank that died
  between steps is an error at the next one.

After a PipelineStepError the Pipeline is unusable (its groups are closed; the stages'
gradients are partial): every later step() raises at once, with no communication.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from moe.comm.consistency import _rank_list, raise_if_any_rank_failed
from moe.comm.topology import group_timeout
from moe.pipeline.groups import PipelineGroups
from moe.pipeline.torch_internals import is_communication_error, original_error
from moe.pipeline.watch import StepInterrupted, Watcher

_KEY = "failures"
_MESSAGE_CHARS = 400


class PipelineStepError(RuntimeError):
    """A pipeline step failed on one or more ranks: raised on every rank, naming each failing
    rank, its stage and the original exception's type and message. The Pipeline cannot step
    again (build a new one, on a new mesh: its process groups may hold unfinished work)."""


class StepGuard:
    """The fault handling of one Pipeline (see the module docstring), built collectively with
    it, before its stages are parallelized: `mesh` (the user's mesh's layout over the
    pipeline's own groups, PipelineGroups) is what the stages communicate over, `pp_group`
    their P2P group."""

    def __init__(self, mesh, stage_indices: list[int], step_timeout: float | None):
        default = group_timeout(None) or datetime.timedelta(minutes=30)
        self.timeout = default if step_timeout is None else datetime.timedelta(seconds=step_timeout)
        self.stage_indices = list(stage_indices)
        self.rank = dist.get_rank()
        self.groups = PipelineGroups(mesh, self.timeout)
        self.group, self.mesh = self.groups.agreement, self.groups.mesh
        self.pp_group, self.pipeline_ranks = self.groups.pp_group, self.groups.pipeline_ranks
        # the agreement group's store: shared by every rank, new per Pipeline
        self.store = dist.PrefixStore("moe.pipeline/", self.group.get_group_store())
        self.steps = 0
        self.failed: str | None = None
        self._stage_error: tuple[int, BaseException] | None = None
        self.watcher = Watcher(
            functools.partial(_read, self.store),
            self.groups.close,
            name=f"moe.pipeline step watcher {self.group.group_name}",
        )

    def watch(self, modules: list) -> None:
        """Notes which of this rank's stages (`modules`, by stage index) raised in forward."""
        for stage, module in zip(self.stage_indices, modules):
            module.register_forward_hook(functools.partial(self._note, stage), always_call=True)

    def _note(self, stage: int, module, args, output) -> None:
        """After each stage forward: the exception it raised, if any (for the report)."""
        error = sys.exc_info()[1] if output is None else None
        if error is not None and self._stage_error is None:
            self._stage_error = (stage, error)

    def refuse_if_failed(self) -> None:
        if self.failed is not None:
            raise PipelineStepError(
                f"this Pipeline failed earlier and cannot step again; build a new one on a new "
                f"mesh ({self.failed})"
            )

    def agree(self, problem: BaseException | None, rows: list[int]) -> None:
        """Begins a step: the step's input problems (one per rank, or None) exchanged over
        every rank (raise_if_any_rank_failed): a problem anywhere is one ValueError everywhere.
        rows: this rank's rows of x and of target (-1: not held here); a pipeline whose target
        has other rows than its x is a problem too (a loss that broadcasts would train on
        mispaired rows). Ranks must enter the step within step_timeout of each other."""
        self.refuse_if_failed()
        self.steps += 1
        self.call(lambda: self._agree(problem, rows), keep=ValueError)

    def _agree(self, problem: BaseException | None, rows: list[int]) -> None:
        mine = torch.tensor(rows, dtype=torch.long)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        x_rows, target_rows = torch.stack([every[r] for r in self.pipeline_ranks]).amax(0).tolist()
        if problem is None and rows[1] >= 0 and x_rows >= 0 and x_rows != target_rows:
            problem = ValueError(
                f"target has {target_rows} rows, x has {x_rows}: one target row per row of x"
            )
        raise_if_any_rank_failed(problem, self.group, error=ValueError, what="pipeline step")

    def run(self, fn: Callable):
        """call(fn) (the schedule) then a barrier over every rank: its value, or the same
        PipelineStepError on every rank when any rank's part fails."""

        def then_barrier():
            value = fn()
            dist.barrier(group=self.group)  # a failure later in the step reaches us too
            return value

        return self.call(then_barrier)

    def call(self, fn: Callable, keep: type[BaseException] | tuple = ()):
        """fn() on this thread, watched: its value; an exception of a `keep` type as it is (the
        same on every rank by construction); any other exception reported and raised as
        PipelineStepError, as is another rank's report."""
        self.refuse_if_failed()
        self._stage_error = None
        return self._watched(fn, keep)

    def _watched(self, fn: Callable, keep) -> object:
        error = None
        try:
            try:
                self.watcher.begin()
                value = fn()
            finally:
                self.watcher.end()
        except BaseException as e:  # noqa: BLE001 - reported, then raised as PipelineStepError
            error = e
        self.watcher.end()  # again: the interruption may have landed in the first end()
        if self.watcher.error is not None:
            raise self._lost(self.watcher.error) from error
        if self.watcher.reports is not None:  # another rank failed (we may have been interrupted)
            raise self._fail(self._read_or(self.watcher.reports)) from _cause(error)
        if error is None:
            return value
        if isinstance(error, keep):
            raise error
        reports = self._read_or([self._report(error)])
        if isinstance(error, KeyboardInterrupt | SystemExit):
            self._fail(reports)
            raise error
        raise self._fail(reports) from error

    def _report(self, error: BaseException) -> dict:
        cause = original_error(error)
        noted = self._stage_error
        stage = noted[0] if noted and noted[1] is cause else _one_or_all(self.stage_indices)
        report = {
            "step": self.steps,
            "rank": self.rank,
            "stage": stage,
            "type": type(cause).__name__,
            "message": _clip(cause),
            "comm": is_communication_error(cause),
        }
        with contextlib.suppress(Exception):  # the store may be gone with its host
            self.store.append(_KEY, json.dumps(report) + "\n")
        return report

    def _read_or(self, fallback: list[dict]) -> list[dict]:
        try:
            return _read(self.store) or fallback
        except Exception:  # noqa: BLE001 - the store's host may be gone: what we know
            return fallback

    def _lost(self, error: BaseException) -> PipelineStepError:
        self.groups.close()
        self.failed = (
            f"pipeline step {self.steps}: lost the store that carries the ranks' errors "
            f"({type(error).__name__}: {_clip(error)}); its host (rank 0, or torchrun's agent) "
            "may have died"
        )
        return PipelineStepError(self.failed)

    def _fail(self, reports: list[dict]) -> PipelineStepError:
        self.groups.close()  # after the report: a peer released by it reads the report
        self.failed = describe(self.steps, reports)
        return PipelineStepError(self.failed)


def describe(step: int, reports: list[dict]) -> str:
    """The error every rank raises: each failing rank (identical reports merged), its stage
    and the original exception; communication errors only when no rank reported another."""
    causes = [r for r in reports if not r["comm"]] or reports
    by_text: dict[str, list[int]] = {}
    for r in causes:
        stage = r["stage"]
        where = (
            f"stage {stage}" if isinstance(stage, int) else "stages " + ", ".join(map(str, stage))
        )
        text = f"({where}): {r['type']}: {r['message']}"
        ranks = by_text.setdefault(text, [])
        if r["rank"] not in ranks:
            ranks.append(r["rank"])
    parts = [f"{_rank_list(sorted(ranks))} {text}" for text, ranks in by_text.items()]
    head = f"pipeline step {step} failed on " + "; ".join(parts[:8])
    if len(parts) > 8:
        head += f"; ... and {len(parts) - 8} more"
    if causes is reports and all(r["comm"] for r in reports):
        head += " (communication errors only: a rank may have died or stopped responding)"
    return (
        head + ". Every rank raises PipelineStepError; this Pipeline cannot step again "
        "(its process groups may hold unfinished transfers)"
    )


def _one_or_all(stages: list[int]) -> int | list[int]:
    return stages[0] if len(stages) == 1 else stages


def _clip(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "(no message)"
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def _parse(data: bytes) -> list[dict]:
    """The reports in the store (written by this module; malformed lines are skipped)."""
    reports = []
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            r = json.loads(line)
            if isinstance(r, dict) and {"rank", "stage", "type", "message", "comm"} <= set(r):
                reports.append(r)
    return reports


def _cause(error: BaseException | None) -> BaseException | None:
    """The local exception to chain, not the watcher's interruption."""
    return None if isinstance(error, StepInterrupted) else error


def _read(store) -> list[dict]:
    """Every rank's reports so far (raises when the store is unreachable)."""
    if not store.check([_KEY]):
        return []
    return _parse(store.get(_KEY))
