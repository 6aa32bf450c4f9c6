"""Checkpoints of the M6 example under --pp: a --pp 2 --ep 2 run stopped (--stop-after) or
signalled (SIGTERM on one rank) saves, and --resume continues it with the uninterrupted run's
losses; the checkpoint holds the single-process names, so a --pp 2 checkpoint resumes at --pp 1
(--ep 2 on 4 ranks, and one process) and a one-process checkpoint resumes under --pp 2. The
routing traces of the stages (routing_trace.stage-S.jsonl) hold the one-process run's expert
loads, resumed ones too, and draw expert_load.png."""

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from examples.m6 import plots, train
from examples.m6.ckpt_io import complete_steps
from examples.m6.trace_io import stage_trace_files
from moe.trace.routing_trace import read_trace
from tests.distributed import run_ranks

FAST = ["--quiet", "--no-plots", "--eval-every", "1000", "--micro-batch", "8", "--steps", "4"]
PP = ["--pp", "2", "--ep", "2"]


def _run(run_dir, *extra):
    return train.run(["--run-dir", str(run_dir), *FAST, *extra])


def _signalling(inner, call: int):
    """`inner` (train.train_step) that sends this process SIGTERM before its `call`-th call."""
    calls = [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop's StopOnSignal takes it
        return inner(*args, **kwargs)

    return step


def _ranks(rank, world, root):
    root = Path(root)
    out = {"full": _run(root / "full", *PP)["losses"]}
    out["stop_checkpoint"] = _run(root / "stop", *PP, "--stop-after", "2")["checkpoint"]
    if rank == 0:  # the step-2 run folder, for --pp 1 and one process
        shutil.copytree(root / "stop", root / "stop-pp1")
        shutil.copytree(root / "stop", root / "stop-single")
    dist.barrier()
    out["resumed"] = _run(root / "stop", *PP, "--resume")["losses"]
    out["pp1"] = _run(root / "stop-pp1", "--ep", "2", "--resume")["losses"]
    out["from_single"] = _run(root / "single-stop", *PP, "--resume")["losses"]
    rebalance = [*PP, "--rebalance-every", "1"]  # the checkpoint holds the expert placement
    out["rb_full"] = _run(root / "rb", *rebalance)["losses"]
    _run(root / "rb-stop", *rebalance, "--stop-after", "2")
    out["rb_resumed"] = _run(root / "rb-stop", *rebalance, "--resume")["losses"]
    step = train.train_step
    if rank == 1:  # a signal on one rank stops every rank after the same step
        train.train_step = _signalling(step, 3)
    try:
        _run(root / "term", *PP, "--log-every", "1")
        out["interrupted"] = None
    except train.Interrupted as e:
        out["interrupted"] = (e.signum, e.step, e.checkpoint and e.checkpoint.name)
    finally:
        train.train_step = step
    out["term_steps"] = [s for s, _ in complete_steps(root / "term" / "checkpoint")]
    out["term_resumed"] = _run(root / "term", *PP, "--resume")["losses"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("m6-pp-ckpt")
    single = _run(root / "single")["losses"]
    _run(root / "single-stop", "--stop-after", "2")
    ranks = run_ranks(_ranks, 4, str(root), timeout=300)
    resumed_single = _run(root / "stop-single", "--resume")["losses"]
    return ranks, single, resumed_single, root


def _loads(files) -> dict:
    """{(step, layer): (routed, kept per expert, dropped)} of trace files."""
    return {
        (r["step"], r["layer"]): (r["routed_per_expert"], r["tokens_per_expert"], r["dropped"])
        for f in files
        for r in read_trace(f)
    }


def test_every_rank_reports_the_same_runs(results):
    ranks = results[0]
    for r in ranks[1:]:
        assert r == ranks[0]


def test_stop_after_saves_and_resume_equals_the_uninterrupted_run(results):
    r = results[0][0]
    assert r["stop_checkpoint"] is not None and r["stop_checkpoint"].endswith("step-00000002")
    assert len(r["full"]) == 4
    assert r["resumed"] == pytest.approx(r["full"], rel=1e-6, abs=1e-7)


def test_a_pp2_checkpoint_resumes_at_pp1_and_on_one_process(results):
    r, single, resumed_single = results[0][0], results[1], results[2]
    assert r["full"] == pytest.approx(single, rel=1e-5, abs=1e-6)  # the same math
    assert r["pp1"][2:] == pytest.approx(r["full"][2:], rel=1e-5, abs=1e-6)
    assert resumed_single[2:] == pytest.approx(r["full"][2:], rel=1e-5, abs=1e-6)


def test_a_one_process_checkpoint_resumes_under_pp2(results):
    r, single = results[0][0], results[1]
    assert r["from_single"] == pytest.approx(single, rel=1e-5, abs=1e-6)


def test_sigterm_on_one_rank_saves_the_step_and_resumes(results):
    r = results[0][0]
    assert r["interrupted"] == (signal.SIGTERM, 3, "step-00000003"), r["interrupted"]
    assert r["term_steps"] == [3]
    assert r["term_resumed"] == pytest.approx(r["full"], rel=1e-6, abs=1e-7)


def test_stage_traces_hold_the_one_process_expert_loads(results, tmp_path):
    root = results[3]
    files = stage_trace_files(root / "full")
    assert [f.name for f in files] == ["routing_trace.stage-0.jsonl", "routing_trace.stage-1.jsonl"]
    single = _loads([root / "single" / "routing_trace.jsonl"])
    assert len(single) == 4 * 2  # 4 steps x 2 MoE layers
    assert _loads(files) == single
    assert _loads(stage_trace_files(root / "stop")) == single  # stopped at 2, resumed to 4
    png = plots.plot_expert_load(files, tmp_path / "expert_load.png", "--pp 2 --ep 2")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rebalanced_pp_run_resumes_with_its_placement(results):
    r, single = results[0][0], results[1]
    assert r["rb_full"] == pytest.approx(single, rel=1e-5, abs=1e-6)  # the same function
    assert r["rb_resumed"] == pytest.approx(r["rb_full"], rel=1e-6, abs=1e-7)
