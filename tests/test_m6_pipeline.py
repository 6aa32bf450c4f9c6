"""M6 on pipeline stages (`--pp`, issue 47 item 5): `--pp 2 --ep 2` on 4 gloo ranks trains to
the single-process run's held-out accuracy (within 1 point; its losses step for step), the
interleaved and V schedules (the tied embedding across ranks and within one rank) and FSDP2
give the single-process losses, and bad --pp / --schedule settings are one `error:` line on
every rank before any work."""

import contextlib
import io
import os

import pytest

from examples.m6 import train
from examples.m6.trace_io import stage_trace_files
from moe.trace.routing_trace import read_trace
from tests.distributed import run_ranks

FAST = ["--quiet", "--no-plots", "--eval-every", "1000"]
LONG = 100  # steps: held-out caption accuracy ~40 % (chance 10 %)
SHORT = 3

# (arguments, the start of the error line): refused on 4 ranks before any work
REFUSED = [
    (
        ["--pp", "2", "--ep", "2", "--schedule", "zero"],
        "error: --schedule zero is not one of GPipe, 1F1B, Interleaved1F1B",
    ),
    (["--pp", "3"], "error: --pp 3 x --dp 1 x --ep 1 = 3 is not the world size 4"),
    (["--pp", "2", "--ep", "2", "--spare-slots", "2"], "error: --pp 2 with --spare-slots"),
    (["--pp", "2", "--ep", "2", "--micro-batch", "32"], "error: --pp 2 --schedule 1F1B"),
    (["--pp", "2", "--ep", "3"], "error: --pp 2 x --dp 1 x --ep 3 = 6 is not the world size 4"),
    (["--ep", "2", "--schedule", "GPipe"], "error: --schedule GPipe needs --pp > 1"),
    (
        ["--pp", "2", "--ep", "2", "--schedule", "ZBVZeroBubble", "--data-parallel", "fsdp"],
        "error: --pp 2 --schedule ZBVZeroBubble",
    ),
]

# short runs: (name, arguments) against the single-process run with --micro-batch 8
SCHEDULES = {
    # stages embed b0 | b1 b2 | b3 | head: rank r holds stages r and 3 - r (both ends on one)
    "zbv_ddp": ["--schedule", "ZBVZeroBubble"],
    # stage s on pp rank s % 2: the last stage (head) on the second pp rank
    "interleaved_fsdp": ["--schedule", "interleaved1f1b", "--data-parallel", "fsdp"],
    # moe.memory.GroupedApply over each rank's stage parameters, optimizer state on the host
    "groups_offload": ["--groups", "2", "--offload", "optimizer"],
    # activation checkpointing of every block (moe.memory.recompute_blocks), FSDP2 units
    "recompute_fsdp": ["--checkpointing", "--data-parallel", "fsdp"],
    # experts re-placed on the stage's EP ranks after every step: the same function, and the
    # evaluation (the model gathered from the stages) sees the placement
    "rebalance": ["--rebalance-every", "1"],
}


def _run(run_dir, *extra, steps):
    return train.run(["--steps", str(steps), "--run-dir", str(run_dir), *FAST, *extra])


def _short(summary):
    return summary["losses"], summary["heldout_loss"]


def _refused(run_dir, argv):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        status = train.main([*argv, "--run-dir", run_dir, "--quiet"])
    return status, err.getvalue(), os.path.exists(run_dir)


def _ranks(rank, world, root):
    refused = [_refused(os.path.join(root, f"bad{i}"), a) for i, (a, _) in enumerate(REFUSED)]
    runs = {
        name: _short(_run(os.path.join(root, name), "--pp", "2", "--ep", "2", "--micro-batch",
                          "8", *extra, steps=SHORT))
        for name, extra in SCHEDULES.items()
    }  # fmt: skip
    full = _run(os.path.join(root, "pp"), "--pp", "2", "--ep", "2", "--micro-batch", "16",
                steps=LONG)  # fmt: skip
    keys = ("losses", "caption_accuracy", "caption_correct", "caption_total", "heldout_loss",
            "checkpoint", "pp", "settings")  # fmt: skip
    return refused, runs, {k: full[k] for k in keys}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("m6-pp")
    ranks = run_ranks(_ranks, 4, str(root), timeout=300)
    # one process, the same routing groups: micro-batches of the pipelines' size
    single = _run(root / "single", "--micro-batch", "16", steps=LONG)
    short = _short(_run(root / "single-short", "--micro-batch", "8", steps=SHORT))
    moved = {  # the rebalance records of the stages' routing traces: (layer, slots moved)
        (r["layer"], r["slots_moved"])
        for f in stage_trace_files(root / "rebalance")
        for r in read_trace(f)
        if r.get("kind") == "rebalance"
    }
    return ranks, single, short, moved


def test_pp2_ep2_trains_to_the_single_process_accuracy(results):
    ranks, single = results[:2]
    for _, _, full in ranks:
        assert full == ranks[0][2]  # every rank reports the same run
    full = ranks[0][2]
    assert full["pp"] == 2 and full["checkpoint"].endswith(f"step-{LONG:08d}")
    assert "pipeline pp 2 (4 ranks), 1F1B, 2 micro-batches of 16" in full["settings"]
    assert full["caption_total"] == single["caption_total"]
    assert single["caption_accuracy"] > 0.3, single["caption_accuracy"]  # well above chance
    assert abs(full["caption_accuracy"] - single["caption_accuracy"]) <= 0.01, (
        full["caption_accuracy"],
        single["caption_accuracy"],
    )
    # the same math step for step: the logged loss is the global-batch mean on both
    assert len(full["losses"]) == LONG
    assert full["losses"][:20] == pytest.approx(single["losses"][:20], rel=1e-5, abs=1e-6)
    assert full["losses"] == pytest.approx(single["losses"], rel=1e-3, abs=1e-4)
    assert full["heldout_loss"] == pytest.approx(single["heldout_loss"], rel=1e-3)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_other_schedules_and_fsdp_give_the_single_process_losses(results, name):
    ranks, short = results[0], results[2]
    for _, runs, _ in ranks:
        (losses, heldout), (want, want_heldout) = runs[name], short
        assert losses == pytest.approx(want, rel=1e-5, abs=1e-6), (name, losses, want)
        assert heldout == pytest.approx(want_heldout, rel=1e-5), (name, heldout, want_heldout)


@pytest.mark.parametrize("i", range(len(REFUSED)))
def test_bad_pipeline_flags_are_one_error_line_before_any_work(results, i):
    ranks = results[0]
    argv, message = REFUSED[i]
    for refused, _, _ in ranks:
        status, err, created = refused[i]
        assert status == 2, (argv, status, err)
        assert err.startswith(message) and err.count("\n") == 1, (argv, err)
        assert not created, argv  # refused before the run directory was made


def test_pp_needs_its_processes(tmp_path):
    with pytest.raises(train.UsageError, match="--pp 2 --dp 1 --ep 2 needs 4 processes: launch"):
        train.run(["--pp", "2", "--ep", "2", "--run-dir", str(tmp_path), "--quiet"])


def test_rebalancing_under_pp_moves_experts_and_is_traced_per_stage(results):
    moved = results[3]
    assert {layer for layer, _ in moved} == {"blocks.1.ffn", "blocks.3.ffn"}, moved
    assert any(n > 0 for _, n in moved), moved  # experts did move (same losses above)
