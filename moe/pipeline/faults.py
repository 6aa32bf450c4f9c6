"""A failure inside a pipeline step is one named error on every rank, in bounded time.

What PyTorch 2.13 offers on gloo, and what is used: a group created with a timeout bounds its
P2P receives and collectives (a dead peer's closed connection fails them at once);
ProcessGroup.set_timeout bounds later collectives of an existing group (not its receives);
ProcessGroup.abort / shutdown do nothing on gloo (a blocked wait stays blocked), so no rank can
be woken out of a wait. What is added here, in StepGuard:

- the step's schedule runs on a worker thread (one per Pipeline, so thread-local caches
  persist) while the calling thread watches the default c10d store, the out-of-band channel:
  a rank whose part fails appends a report (rank, stage, the original exception's type and
  message) and raises; every other rank's calling thread sees the report within POLL_S to
  POLL_MAX_S (1 s) and raises the same PipelineStepError, even while its worker still waits
  for the failed rank;
- every wait of the step is bounded by step_timeout: the pipeline's P2P groups are created
  with it, and every process group of the process has it for the step's duration (set
  before, restored after), so a worker left waiting ends too; a worker that gets out of its
  wait after the error stops at its next stage forward;
- the step ends with a barrier over every rank (a gloo group with step_timeout), so a rank
  that finished its part still learns of a failure later in the step. The check of the
  step's inputs (and, at the first step, the search for the stage shapes) run on the worker
  too, watched the same way: a rank that died between steps is an error at the next one.

After a PipelineStepError the Pipeline is unusable: a worker may still wait in a transfer
(until step_timeout) and the stages' gradients are partial. Every later step() raises at once,
with no communication.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import queue
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from moe.comm.consistency import _rank_list, raise_if_any_rank_failed
from moe.comm.topology import group_timeout

# how often a waiting rank reads the store for another rank's report: every POLL_S at first,
# then less often up to every POLL_MAX_S (one small request per rank, to one store host)
POLL_S, POLL_MAX_S = 0.05, 1.0
_KEY = "failures"
_MESSAGE_CHARS = 400
_COMM_MARKS = ("third_party/gloo", "Connection closed by peer", "Connection reset", "NCCL")


class PipelineStepError(RuntimeError):
    """A pipeline step failed on one or more ranks: raised on every rank, naming each failing
    rank, its stage and the original exception's type and message. The Pipeline cannot step
    again (build a new one, on a new mesh: its process groups may hold unfinished work)."""


class StepGuard:
    """The fault handling of one Pipeline (see the module docstring). Built collectively at
    its first step: a gloo group over every rank and one P2P group per pipeline, both with
    `timeout`; `pp_group` is this rank's."""

    def __init__(self, mesh, modules: list, stage_indices: list[int], step_timeout: float | None):
        default = group_timeout(None) or datetime.timedelta(minutes=30)
        self.timeout = default if step_timeout is None else datetime.timedelta(seconds=step_timeout)
        self.stage_indices = list(stage_indices)
        self.rank = dist.get_rank()
        self.group = dist.new_group(timeout=self.timeout, backend="gloo")
        layout = mesh.mesh.reshape(mesh.size(0), -1)  # pp x (one column per pipeline)
        self.pp_group = None
        for column in layout.t().tolist():
            group = dist.new_group(column, timeout=self.timeout, sort_ranks=False)
            if self.rank in column:
                self.pp_group = group
        # the agreement group's name is the same on every rank and new per Pipeline
        self.store = dist.PrefixStore(
            f"moe.pipeline/{self.group.group_name}/", dist.distributed_c10d._get_default_store()
        )
        self.steps = 0
        self.failed: str | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        worker = threading.Thread(target=_serve, args=(self._jobs,), daemon=True)
        worker.name = f"moe.pipeline step worker {self.group.group_name}"
        worker.start()
        # the worker ends with its guard, or at exit before the process groups are torn down
        # (a worker still running then aborts the process); it may be left in a failed
        # step's wait: joined for at most a second
        weakref.finalize(self, _stop_worker, self._jobs, worker)
        for module in modules:  # before FSDP's own hook: no all-gather for a failed step
            module.register_forward_pre_hook(self._stop_if_failed, prepend=True)

    def _stop_if_failed(self, module, args) -> None:
        if self.failed is not None:
            raise PipelineStepError(f"stopped: {self.failed}")

    def refuse_if_failed(self) -> None:
        if self.failed is not None:
            raise PipelineStepError(
                f"this Pipeline failed earlier and cannot step again; build a new one on a new "
                f"mesh ({self.failed})"
            )

    def agree(self, problem: BaseException | None) -> None:
        """Begins a step: the step's input problems (one per rank, or None) exchanged over
        every rank (raise_if_any_rank_failed): a problem anywhere is one ValueError everywhere.
        Ranks must enter the step within step_timeout of each other."""
        self.refuse_if_failed()
        self.steps += 1
        self.call(
            lambda: raise_if_any_rank_failed(
                problem, self.group, error=ValueError, what="pipeline step"
            ),
            keep=ValueError,
        )

    def run(self, fn: Callable):
        """call(fn) (the schedule) then a barrier over every rank: its value, or the same
        PipelineStepError on every rank when any rank's part fails."""

        def then_barrier():
            value = fn()
            dist.barrier(group=self.group)  # a failure later in the step reaches us too
            return value

        return self.call(then_barrier)

    def call(self, fn: Callable, keep: type[BaseException] | tuple = ()):
        """fn() on the worker thread, every process group's collectives bounded by
        step_timeout, while this thread watches the store: its value; an exception of a `keep`
        type as it is (the same on every rank by construction); any other exception reported
        and raised as PipelineStepError, as is another rank's report."""
        self.refuse_if_failed()
        saved = _bound_groups(self.timeout)
        try:
            return self._call(fn, keep)
        finally:
            _restore_groups(saved)

    def _call(self, fn: Callable, keep) -> object:
        box: dict = {}
        done = threading.Event()
        carried = _carried(fn)

        def job() -> None:
            try:
                box["value"] = carried()
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                box["error"] = e
            finally:
                done.set()

        self._jobs.put(job)
        poll = POLL_S
        try:
            while not done.wait(poll):
                reports = self._read()
                if reports:
                    raise self._fail(reports)
                poll = min(2 * poll, POLL_MAX_S)
        except PipelineStepError:
            raise
        except BaseException as e:  # interrupted: the worker may still run
            self.failed = f"pipeline step {self.steps} was interrupted ({type(e).__name__})"
            raise
        error = box.get("error")
        if error is None:
            return box["value"]
        if isinstance(error, keep):
            raise error
        report = self._report(error)
        try:
            reports = self._read() or [report]
        except PipelineStepError:
            reports = [report]
        raise self._fail(reports) from error

    def _report(self, error: BaseException) -> dict:
        cause = _original(error)
        stage = _stage_of(error)
        report = {
            "step": self.steps,
            "rank": self.rank,
            "stage": stage if stage is not None else _one_or_all(self.stage_indices),
            "type": type(cause).__name__,
            "message": _clip(cause),
            "comm": _is_communication(cause),
        }
        with contextlib.suppress(Exception):  # the store may be gone with its host
            self.store.append(_KEY, json.dumps(report) + "\n")
        return report

    def _read(self) -> list[dict]:
        try:
            if not self.store.check([_KEY]):
                return []
            data = self.store.get(_KEY)
        except Exception as e:  # noqa: BLE001 - the store's host (rank 0) may have died
            self.failed = (
                f"pipeline step {self.steps}: lost the store that carries the ranks' errors "
                f"({type(e).__name__}: {_clip(e)}); its host (rank 0, or torchrun's agent) "
                "may have died"
            )
            raise PipelineStepError(self.failed) from e
        return _parse(data)

    def _fail(self, reports: list[dict]) -> PipelineStepError:
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


def _stop_worker(jobs: queue.SimpleQueue, worker: threading.Thread) -> None:
    jobs.put(None)
    if worker is not threading.current_thread():
        worker.join(timeout=1.0)


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job()


def _carried(fn: Callable) -> Callable:
    """fn with the calling thread's grad mode, autocast, CUDA device and stream, context
    variables and TorchDispatchModes (thread-local: a worker thread would not see them; a
    memory or FLOP counter around step() would silently miss the stages' work). Other
    thread-local state entered around step() (saved_tensors_hooks, ...) does not reach the
    stages."""
    grad = torch.is_grad_enabled()
    casts = [
        (d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    ]
    stream = (
        torch.cuda.current_stream()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    context = contextvars.copy_context()
    modes = _get_current_dispatch_mode_stack()

    def call():
        with contextlib.ExitStack() as stack:
            stack.enter_context(_dispatch_modes(modes))
            stack.enter_context(torch.set_grad_enabled(grad))
            for device_type, dtype in casts:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if stream is not None:
                torch.cuda.set_device(stream.device)
                stack.enter_context(torch.cuda.stream(stream))
            return context.run(fn)

    return call


@contextlib.contextmanager
def _dispatch_modes(modes: list):
    """The caller's dispatch modes on this thread's stack (their __enter__ ran on the caller's
    thread, and the caller waits: only the stack is per thread), popped after."""
    for mode in modes:
        _push_mode(mode)
    try:
        yield
    finally:
        for mode in reversed(modes):
            _pop_mode(mode.__dict__.get("_dispatch_key") or mode.__dict__.get("_mode_key"))


def _bound_groups(timeout: datetime.timedelta) -> list:
    """Every process group of this process gets `timeout` (later collectives only); their
    previous timeouts, to restore."""
    saved = []
    for group in list(dist.distributed_c10d._world.pg_map):
        old = group_timeout(group)
        if old is not None and old != timeout:
            with contextlib.suppress(RuntimeError):  # a backend without timeouts
                group.set_timeout(timeout)
                saved.append((group, old))
    return saved


def _restore_groups(saved: list) -> None:
    for group, old in saved:
        group.set_timeout(old)


def _original(error: BaseException) -> BaseException:
    """The exception a stage raised, without PyTorch's pipelining wrappers ("failed to run
    forward", "Failed to run stage backward": a RuntimeError raised from it)."""
    while (
        type(error) is RuntimeError and error.__cause__ is not None and _raised_in_pipelining(error)
    ):
        error = error.__cause__
    return error


def _raised_in_pipelining(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "torch/distributed/pipelining" in tb.tb_frame.f_code.co_filename


def _stage_of(error: BaseException) -> int | None:
    """The index of the stage whose forward or backward raised (the innermost PipelineStage
    method on the traceback), None when it was not inside one (a transfer of the schedule)."""
    stage = None
    for tb in _frames(error.__traceback__):
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, _PipelineStageBase):
            stage = owner.stage_index
    return stage


def _one_or_all(stages: list[int]) -> int | list[int]:
    return stages[0] if len(stages) == 1 else stages


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _is_communication(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        any(mark in text for mark in _COMM_MARKS) or text.startswith("Timed out waiting")
    )


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
