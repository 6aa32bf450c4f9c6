"""Faults inside a pipeline step (issue 47): an exception on one rank (a stage's forward after
the shapes were found, the router's finite check, a backward) is the same PipelineStepError on
every rank, naming the rank, its stage and the original error, within step_timeout; a rank
killed mid-step ends every other rank's step with an error within step_timeout, never a hang.
The schedule runs on the thread that calls step() (issue 59): thread-local state around it
reaches the stages, and no process group outside the pipeline's mesh changes its timeout.
Times to the error are deadlines that report (a warning), not asserts (issue 62).

4 gloo ranks, pp=2 x ep=2 (stage 0 on ranks 0-1, stage 1 on ranks 2-3; the V schedule puts
stages 1 and 2 on ranks 2-3). Each case builds its own mesh: a failed step leaves transfers
pending on its groups."""

import datetime
import os
import re
import threading
import time
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from moe.comm.topology import group_timeout
from moe.parallel import ParallelConfig
from moe.pipeline import Pipeline, PipelineConfig, PipelineStepError, init_pipeline_mesh
from moe.pipeline.config import MIN_STEP_TIMEOUT
from moe.pipeline.faults import describe
from moe.pipeline.torch_internals import CHECKED_ON
from tests.distributed import run_ranks
from tests.test_pipeline import ROWS, Block, D, Head, S, V

STEP_TIMEOUT = 10.0  # seconds; a bound on every rank's time to the error, not a timing target
STALL_TIMEOUT = 3.0  # the step_timeout of the case whose rank stalls (for 30 s)
MARGIN = 5.0  # seconds past a deadline before it is reported (a loaded machine)
M = 2  # micro-batches: the fault hits the second one (call 1) or a later step's


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(f"fault in the backward on rank {dist.get_rank()}")


class Fault(nn.Module):
    """Identity, except in the `call`-th training forward (0-based, counted over steps) on
    world rank `rank`: raise, put NaN into the activations, die, stall (a rank alive but stuck
    in Python code, here sleeping in slices: the test's fault, not a synchronisation), or raise
    in its backward.
    The eval-mode forward that finds the stage shapes does not count."""

    stall_ended = False

    def __init__(self, kind=None, rank=-1, call=1):
        super().__init__()
        self.kind, self.rank, self.call, self.calls = kind, rank, call, 0

    def forward(self, x):
        if not self.training or self.kind is None or dist.get_rank() != self.rank:
            return x
        self.calls += 1
        if self.calls - 1 != self.call:
            return x
        if self.kind == "raise":
            raise ValueError(f"bad input found on rank {self.rank}")
        if self.kind == "nan":
            return x * float("nan")
        if self.kind == "die":
            os._exit(3)
        if self.kind == "stall":
            end = time.monotonic() + 10 * STALL_TIMEOUT
            while time.monotonic() < end:
                time.sleep(0.05)
            Fault.stall_ended = True  # not interrupted
            return x
        return _RaiseInBackward.apply(x)


def build_model(faults):
    """embed f0 b0 b1 | f1 b2 b3 head (b1, b3 MoE); Fault children f0, f1 per `faults`."""
    torch.manual_seed(0)
    children = [("embed", nn.Embedding(V, D)), ("f0", Fault(*faults.get("f0", ())))]
    children += [(f"b{i}", Block(i % 2 == 1)) for i in range(2)]
    children += [("f1", Fault(*faults.get("f1", ())))]
    children += [(f"b{i}", Block(i % 2 == 1)) for i in range(2, 4)]
    return nn.Sequential(OrderedDict([*children, ("head", Head())])).double()


TWO = [["embed", "f0", "b0", "b1"], ["f1", "b2", "b3", "head"]]
V_STAGES = [["embed", "f0", "b0"], ["b1"], ["f1", "b2"], ["b3", "head"]]  # 1, 2 on ranks 2-3

# name: schedule, data_parallel, stages, stages_per_rank, {fault child: (kind, rank, call)}
CASES = {
    # a later step's second micro-batch: step 1 succeeds on every rank
    "1f1b_forward": ("1F1B", "fsdp", TWO, 1, {"f1": ("raise", 2, 3)}),
    "gpipe_forward": ("GPipe", "ddp", TWO, 1, {"f1": ("raise", 3, 1)}),
    "zbv_forward": ("ZBVZeroBubble", "ddp", V_STAGES, 2, {"f1": ("raise", 2, 1)}),
    "nan_router": ("1F1B", "ddp", TWO, 1, {"f1": ("nan", 2, 1)}),
    "backward": ("1F1B", "fsdp", TWO, 1, {"f0": ("backward", 1, 1)}),
    # no rank reports an error of its own: the waits on rank 2 time out after STALL_TIMEOUT
    "stall": ("1F1B", "ddp", TWO, 1, {"f1": ("stall", 2, 1)}),
}


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="sum")


def _pipeline(name):
    schedule, data_parallel, stages, v, faults = CASES[name]
    config = PipelineConfig(
        schedule,
        microbatches=M,
        stages_per_rank=v,
        stages=stages,
        step_timeout=STALL_TIMEOUT if name == "stall" else STEP_TIMEOUT,
    )
    mesh = init_pipeline_mesh(2, 1, 2)  # a new mesh, new groups, per case
    parallel = ParallelConfig(data_parallel, "flat")
    return Pipeline(build_model(faults), mesh, config, _loss, parallel)


def _batch(rank):
    g = torch.Generator().manual_seed(rank % 2)
    return torch.randint(V, (ROWS, S), generator=g), torch.randint(V, (ROWS, S), generator=g)


def _timed_step(pipe, x, y):
    start = time.monotonic()
    try:
        pipe.step(x, y)
    except PipelineStepError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def _report_late(what, seconds, deadline):
    """A deadline that reports: a warning, not a failure (the time depends on the machine)."""
    if seconds > deadline:
        warnings.warn(
            f"{what}: {seconds:.1f} s, past its deadline of {deadline:.1f} s", stacklevel=2
        )


def _body(rank, world):
    out = {}
    x, y = _batch(rank)
    for name in CASES:
        pipe = _pipeline(name)
        steps = 0
        error, seconds = _timed_step(pipe, x, y)
        while error is None and steps < 3:
            steps += 1
            error, seconds = _timed_step(pipe, x, y)
        again, again_seconds = _timed_step(pipe, x, y)
        out[name] = {"steps_ok": steps, "error": error, "seconds": seconds, "again": again}
        out[name]["stall_ended"] = Fault.stall_ended
    dist.barrier()  # every rank is out of its failed steps; the world group still works
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 4, timeout=60, deadline=300)


EXPECTED = {
    "1f1b_forward": "pipeline step 2 failed on rank 2 (stage 1): ValueError: bad input found "
    "on rank 2",
    "gpipe_forward": "pipeline step 1 failed on rank 3 (stage 1): ValueError: bad input found "
    "on rank 3",
    "zbv_forward": "pipeline step 1 failed on rank 2 (stage 2): ValueError: bad input found "
    "on rank 2",
    "nan_router": "pipeline step 1 failed on rank 2 (stage 1): FloatingPointError: ",
    "backward": "pipeline step 1 failed on rank 1 (stage 0): RuntimeError: fault in the "
    "backward on rank 1",
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_failing_rank_is_one_named_error_on_every_rank(results, name):
    errors = [results[rank][name]["error"] for rank in range(4)]
    assert all(e is not None for e in errors), errors
    for rank, error in enumerate(errors):
        assert error.startswith(EXPECTED[name]), (rank, error)
        assert "Every rank raises PipelineStepError" in error
        # each wait ends within step_timeout (its peer's closed connection, its timeout)
        _report_late(f"{name}: rank {rank}", results[rank][name]["seconds"], STEP_TIMEOUT + MARGIN)
    assert len(set(errors)) == 1, errors  # one report, read by every rank
    if name == "nan_router":
        assert "router logits contain NaN or Inf" in errors[0]
    want_ok = 1 if name == "1f1b_forward" else 0
    assert [results[rank][name]["steps_ok"] for rank in range(4)] == [want_ok] * 4
    for rank in range(4):  # a failed Pipeline refuses to step again, on every rank
        again = results[rank][name]["again"]
        assert again.startswith("this Pipeline failed earlier and cannot step again"), again


def test_a_stalled_rank_ends_every_step_within_step_timeout(results):
    """Rank 2 stalls (alive, silent) in its second forward: the waits on it time out after
    STALL_TIMEOUT, and every rank raises, rank 2 too (the watcher interrupts its stall)."""
    for rank in range(4):
        out = results[rank]["stall"]
        error = out["error"]
        assert error.startswith("pipeline step 1 failed on rank"), (rank, error)
        assert "Timed out waiting" in error, error  # gloo's timeout, after step_timeout
        assert "communication errors only: a rank may have died or stopped" in error, error
        assert not out["stall_ended"], (rank, out)  # rank 2 was interrupted, not let finish
        _report_late(f"stall: rank {rank}", out["seconds"], STALL_TIMEOUT + MARGIN)
        assert out["again"].startswith("this Pipeline failed earlier"), out["again"]


def _kill_body(rank, world):
    pipe = _pipeline_with({"f1": ("die", 2, 1)})
    x, y = _batch(rank)
    start = time.monotonic()
    try:
        pipe.step(x, y)
    except PipelineStepError as e:
        seconds = time.monotonic() - start
        raise PipelineStepError(f"rank {rank} released after {seconds:.2f} s: {e}") from None
    return "finished"


def _pipeline_with(faults):
    config = PipelineConfig("1F1B", microbatches=M, stages=TWO, step_timeout=STEP_TIMEOUT)
    mesh = init_pipeline_mesh(2, 1, 2)
    return Pipeline(build_model(faults), mesh, config, _loss, ParallelConfig(algorithm="flat"))


def test_a_rank_killed_mid_step_ends_every_step_with_an_error():
    """Rank 2 dies in its second micro-batch's forward; every other rank raises within
    step_timeout (+ a margin for a loaded machine), none is killed by the harness."""
    with pytest.raises(AssertionError) as info:
        run_ranks(_kill_body, 4, timeout=60, grace=STEP_TIMEOUT + 20)
    message = str(info.value)
    assert "rank 2 exited with code 3 without a result" in message, message
    assert "killed" not in message and "timed out (no result" not in message, message
    released = dict(re.findall(r"rank (\d) released after ([\d.]+) s", message))
    assert sorted(released) == ["0", "1", "3"], message
    for rank, seconds in released.items():
        _report_late(f"killed rank: rank {rank}", float(seconds), STEP_TIMEOUT + MARGIN)
        assert f"--- rank {rank} failed" in message


def test_step_timeout_is_checked():
    assert PipelineConfig(step_timeout=5).step_timeout == 5.0
    assert PipelineConfig().step_timeout is None
    for bad in (0, -1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="step_timeout must be seconds > 0"):
            PipelineConfig(step_timeout=bad)
    assert PipelineConfig(step_timeout=MIN_STEP_TIMEOUT).step_timeout == MIN_STEP_TIMEOUT
    for short in (1e-6, 0.5, MIN_STEP_TIMEOUT - 1e-9):  # every step would fail (issue 62)
        with pytest.raises(ValueError, match="step_timeout must be at least 1 s"):
            PipelineConfig(step_timeout=short)


def test_the_message_names_the_original_errors_before_communication_errors():
    def report(rank, stage, type_, message, comm=False):
        return {
            "step": 3,
            "rank": rank,
            "stage": stage,
            "type": type_,
            "message": message,
            "comm": comm,
        }

    closed = "Connection closed by peer"
    reports = [
        report(0, 0, "RuntimeError", closed, comm=True),
        report(2, 1, "FloatingPointError", "nan"),
        report(3, 1, "FloatingPointError", "nan"),
        report(1, [0, 3], "ValueError", "bad"),
    ]
    text = describe(3, reports)
    assert text.startswith(
        "pipeline step 3 failed on ranks 2-3 (stage 1): FloatingPointError: nan; "
        "rank 1 (stages 0, 3): ValueError: bad. Every rank raises PipelineStepError"
    ), text
    assert closed not in text
    only = describe(3, reports[:1])
    assert only.startswith(f"pipeline step 3 failed on rank 0 (stage 0): RuntimeError: {closed}")
    assert "communication errors only: a rank may have died" in only


class Probe(nn.Module):
    """Identity; in each training forward it records the thread it runs on and the timeout of
    the group `outside` (created outside the pipeline), and saves a tensor for backward."""

    outside = None

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        if not self.training:
            return x
        self.seen.append((threading.get_ident(), group_timeout(Probe.outside).total_seconds()))
        return x if not x.is_floating_point() else x * torch.ones_like(x).requires_grad_()


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


OUTSIDE_TIMEOUT = 123.0


def _caller_body(rank, world):
    """pp=2 (one rank per stage), a probe in each stage, a group made before the pipeline."""
    Probe.outside = dist.new_group(timeout=datetime.timedelta(seconds=OUTSIDE_TIMEOUT))
    torch.manual_seed(0)
    children = [("embed", nn.Embedding(V, D)), ("p0", Probe()), ("b0", Block(False))]
    children += [("p1", Probe()), ("b1", Block(True)), ("head", Head())]
    model = nn.Sequential(OrderedDict(children)).double()
    stages = [["embed", "p0", "b0"], ["p1", "b1", "head"]]
    config = PipelineConfig("1F1B", microbatches=M, stages=stages, step_timeout=STEP_TIMEOUT)
    pipe = Pipeline(model, init_pipeline_mesh(2, 1, 1), config, _loss)
    x, y = _batch(rank)
    packed, unpacked, counted = [], [], _Count()

    def pack(t):
        packed.append(threading.get_ident())
        return t

    def unpack(t):
        unpacked.append(threading.get_ident())
        return t

    try:  # x on rank 0, target on rank 1: 2 target rows for 4 of x (issue 62)
        pipe.step(x, y[:2])
        mispaired = "no error"
    except ValueError as e:
        mispaired = str(e)
    for _ in range(2):  # the first step also finds the stage shapes
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), counted:
            pipe.step(x, y)
    probe = next(m for m in pipe.local_model().modules() if isinstance(m, Probe))
    return {
        "caller": threading.get_ident(),
        "probe": probe.seen,
        "packed": packed,
        "unpacked": unpacked,
        "ops": counted.ops,
        "after": group_timeout(Probe.outside).total_seconds(),
        "mispaired": mispaired,
    }


def test_the_schedule_runs_on_the_calling_thread_with_its_thread_local_state():
    """saved_tensors_hooks and a dispatch mode entered around step() reach the stages' forward
    and backward; each stage's forward runs on the thread that called step(); a group created
    outside the pipeline keeps its timeout during (read in a stage's forward) and after a step
    (the step's own timeout, STEP_TIMEOUT, is set on the pipeline's groups only). Before, a
    target with other rows than x is one ValueError on both ranks (x and target on different
    ranks), before any work."""
    results = run_ranks(_caller_body, 2, timeout=60)
    for rank, out in enumerate(results):
        caller = out["caller"]
        assert len(out["probe"]) == 2 * M, (rank, out["probe"])  # 2 steps x M micro-batches
        assert {thread for thread, _ in out["probe"]} == {caller}, (rank, out["probe"])
        assert {timeout for _, timeout in out["probe"]} == {OUTSIDE_TIMEOUT}, (rank, out)
        assert out["after"] == OUTSIDE_TIMEOUT
        assert out["packed"] and set(out["packed"]) == {caller}, rank  # forward: saved tensors
        assert out["unpacked"] and set(out["unpacked"]) == {caller}, rank  # backward read them
        assert out["ops"] > 0, rank
        want = "pipeline step: rank 1: target has 2 rows, x has 4: one target row per row of x"
        assert out["mispaired"].startswith(want), out["mispaired"]  # then steps: before work


def test_private_torch_assumptions_were_checked_on_this_torch():
    """moe.pipeline.torch_internals holds what the fault handling assumes of torch beyond its
    documented API: on another torch version, check each again and update CHECKED_ON."""
    version = torch.__version__.split("+")[0]
    assert version.startswith(CHECKED_ON + "."), (
        f"torch {version}: re-check moe/pipeline/torch_internals.py (checked on {CHECKED_ON})"
    )


def _watcher(reports, name="test watcher"):
    from moe.pipeline.watch import Watcher

    failures = []
    return Watcher(lambda: list(reports), lambda: failures.append(1), name), failures


def test_the_watcher_interrupts_python_code_once_and_not_after_end():
    """A report during a watched step: StepInterrupted in the calling thread (here a Python
    loop, as a stalled rank), on_failure once; nothing is raised after end()."""
    from moe.pipeline.watch import StepInterrupted

    reports = []
    watcher, failures = _watcher(reports)
    watcher.begin()
    start = time.monotonic()
    with pytest.raises(StepInterrupted):
        while time.monotonic() - start < 30:
            reports.append({"rank": 1})  # another rank's report
            time.sleep(0.01)
    watcher.end()
    _report_late("watcher interrupt", time.monotonic() - start, 2.0)
    assert failures == [1] and watcher.reports
    watcher.begin()  # a report already there: the next step is interrupted too
    with pytest.raises(StepInterrupted):
        for _ in range(3000):
            time.sleep(0.01)
    watcher.end()
    reports.clear()
    watcher.begin()
    watcher.end()  # no report: nothing pending after end()
    for _ in range(30):
        time.sleep(0.01)
    assert watcher.reports is None and failures == [1, 1]


def test_the_watcher_thread_ends_with_its_watcher():
    import gc

    watcher, _ = _watcher([], name="test watcher to collect")
    (thread,) = [t for t in threading.enumerate() if t.name == "test watcher to collect"]
    del watcher
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
