"""Fault injection on the M6 example's command line: killed saves, signals, an unwritable run
directory and bad arguments. Subprocesses run the real CLI (`python examples/m6/train.py`)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.m6 import train
from examples.m6.ckpt_io import complete_steps, load_latest
from examples.m6.config import get_config

ROOT = Path(__file__).resolve().parents[1]
FAST = [
    "--no-plots",
    "--eval-every",
    "1000",
    "--global-batch",
    "8",
    "--threads",
    "1",
    "--log-every",
    "1",
]


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "examples/m6/train.py"), "--run-dir", str(run_dir)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [*cmd, *FAST, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _fresh_model_and_opt():
    import torch

    model = get_config("m6-tiny").build()
    return model, torch.optim.AdamW(model.parameters())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "/nonexistent/moe-data"], "--data /nonexistent/moe-data: no captions.jsonl"),
        (["--capacity-factor", "-1"], "capacity_factor"),
        (["--router", "bogus"], "router='bogus' is unknown"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--clip", "-1"], "--clip must be a finite number >= 0"),
        (["--run-dir", "/proc/moe-run"], "--run-dir /proc/moe-run is not writable"),
        (["--run-dir", "/dev/null/run"], "--run-dir /dev/null/run is not writable"),
    ],
)
def test_bad_arguments_are_one_error_line_before_any_work(argv, message, tmp_path, capsys):
    argv = ["--run-dir", str(tmp_path / "run"), *argv, "--quiet"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_killed_saves_leave_a_loadable_checkpoint(tmp_path):
    """SIGKILL at random moments of a run that saves every step: every published step loads,
    and --resume finishes the run with the losses of an uninterrupted one."""
    steps = "30"
    reference = train.run(["--steps", steps, "--run-dir", str(tmp_path / "ref"), "--quiet", *FAST])
    rng = random.Random(0)
    for trial in range(3):
        run_dir = tmp_path / f"trial{trial}"
        proc = _start(run_dir, "--steps", steps, "--save-every", "1")
        for _line in proc.stdout:  # one line per finished step once training runs
            if _line.startswith("step "):
                break
        time.sleep(rng.uniform(0.0, 0.3))  # a random point of the run, not a synchronisation
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        published = complete_steps(run_dir / "checkpoint")
        if published:
            model, opt = _fresh_model_and_opt()
            state, path, problems = load_latest(run_dir / "checkpoint", model, opt)
            assert problems == [] and state["step"] == published[0][0]
        resumed = train.run(
            ["--steps", steps, "--run-dir", str(run_dir), "--quiet", *FAST]
            + (["--resume"] if published else [])
        )
        assert resumed["losses"] == pytest.approx(reference["losses"], abs=1e-6, rel=0)


def test_resume_falls_back_to_the_newest_step_that_loads(tmp_path):
    train.run(["--steps", "4", "--save-every", "1", "--run-dir", str(tmp_path), *FAST, "--quiet"])
    steps = complete_steps(tmp_path / "checkpoint")
    assert [s for s, _ in steps] == [4, 3]  # the two newest are kept
    (steps[0][1] / "state.json").write_text("{not json")  # the newest is damaged
    model, opt = _fresh_model_and_opt()
    state, path, problems = load_latest(tmp_path / "checkpoint", model, opt)
    assert state["step"] == 3 and path == steps[1][1] and "step-00000004" in problems[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_saves_and_exits_nonzero(sig, tmp_path):
    proc = _start(tmp_path, "--steps", "400")
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"error: interrupted by {signal.Signals(sig).name} after step ")
    step = int(lines[-1].split(" after step ")[1].split(";")[0])
    assert [s for s, _ in complete_steps(tmp_path / "checkpoint")][0] == step
    resumed = train.run(
        ["--steps", str(step + 2), "--run-dir", str(tmp_path), "--resume", "--quiet", *FAST]
    )
    assert resumed["steps_this_run"] == 2 and len(resumed["losses"]) == step + 2
