"""The M6 example's dense baseline runs (no MoE layers: no routing trace), and its routing
trace at a damaged file or a FIFO is one `error:` line naming it, before any training."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from examples.m6 import train
from examples.m6.ckpt_io import complete_steps

FAST = ["--quiet", "--no-plots", "--eval-every", "1000", "--global-batch", "8"]
TRAIN = str(Path(train.__file__))


def _main(tmp_path, *extra, steps=2):
    return train.main(["--steps", str(steps), "--run-dir", str(tmp_path), *FAST, *extra])


@pytest.mark.parametrize("flag", [["--dense"], ["--experts", "0"]])
def test_dense_baseline_trains_without_a_trace(flag, tmp_path, capsys):
    assert _main(tmp_path, *flag) == 0
    assert capsys.readouterr().err == ""
    assert (tmp_path / "checkpoint").exists()
    assert not (tmp_path / "routing_trace.jsonl").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        ('{"step": NaN}\n', "not JSON"),
        ("[" * 100 + "\n", "JSON nested"),
    ],
    ids=["nan", "deep"],
)
def test_resume_with_a_damaged_trace_is_one_error_line(damage, message, tmp_path, capsys):
    assert _main(tmp_path, "--stop-after", "1") == 0
    trace = tmp_path / "routing_trace.jsonl"
    good = trace.read_text()
    trace.write_text(good + damage)
    capsys.readouterr()
    assert _main(tmp_path, "--resume") == 2
    err = capsys.readouterr().err
    lines = len(good.splitlines()) + 1
    assert err.startswith(f"error: {trace}:{lines}: {message}") and err.count("\n") == 1, err
    assert trace.read_text() == good + damage  # left as it was


def test_a_fifo_as_the_trace_is_one_error_line_not_a_hang(tmp_path):
    """--resume with a FIFO as the trace is one error line, never a hang; a fresh run sets
    the FIFO aside with the rest of the earlier run (issue 49 item 9) without opening it."""
    argv = [sys.executable, TRAIN, "--steps", "2", "--run-dir", str(tmp_path), *FAST]
    root = str(Path(train.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    run = subprocess.run([*argv, "--stop-after", "1"], capture_output=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    (tmp_path / "routing_trace.jsonl").unlink()
    os.mkfifo(tmp_path / "routing_trace.jsonl")
    done = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: routing trace") and "not a regular file" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert [s for s, _ in complete_steps(tmp_path / "checkpoint")] == [1]  # nothing trained
    fresh = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert fresh.returncode == 0, fresh.stderr
    assert stat.S_ISFIFO(os.lstat(tmp_path / "old-1" / "routing_trace.jsonl").st_mode)


def _rebalancing_ranks(rank, world, run_dir):
    argv = ["--experts", "8", "--rebalance-every", "2", "--spare-slots", "2", "--log-every", "2"]
    argv += ["--steps", "4", "--run-dir", run_dir, "--dp", "1", "--ep", "2", *FAST]
    return train.main(argv)


def test_rebalance_with_spare_slots_writes_records_to_the_trace(tmp_path):
    """2 gloo ranks, --rebalance-every 2 --spare-slots 2: each rebalance's per-layer summary
    is in the routing trace (read back by read_trace, skipped by the plot tool), no
    rebalance.jsonl."""
    import moe
    from moe.trace import plot as plot_trace
    from tests.distributed import run_ranks

    assert run_ranks(_rebalancing_ranks, 2, str(tmp_path), timeout=180) == [0, 0]
    records = moe.read_trace(tmp_path / "routing_trace.jsonl")
    rebalances = [r for r in records if r.get("kind") == "rebalance"]
    layers = {r["layer"] for r in records if "kind" not in r}
    assert [r["step"] for r in rebalances] == [2] * len(layers) + [4] * len(layers)
    assert {r["layer"] for r in rebalances} == layers
    for r in rebalances:
        assert r["ep"] == 2 and len(r["copies_per_expert"]) == 8
        assert sum(r["copies_per_expert"]) == 10 and max(r["copies_per_expert"]) == 2
        assert r["max_over_mean_after"] <= r["max_over_mean_before"] + 1e-9
    assert not (tmp_path / "rebalance.jsonl").exists()
    assert plot_trace.main([str(tmp_path / "routing_trace.jsonl"), str(tmp_path / "t.png")]) == 0
    from bench.rebalance import m6_trace_loads  # the M6 rows of python -m bench.rebalance

    loads = m6_trace_loads(str(tmp_path / "routing_trace.jsonl"), 2)
    assert set(loads) == layers
    for name, share in loads.items():
        last = [r["routed_per_expert"] for r in records if r["layer"] == name and "kind" not in r]
        want = [(a / sum(last[-2]) + b / sum(last[-1])) / 2 for a, b in zip(*last[-2:])]
        assert share == pytest.approx(want)
