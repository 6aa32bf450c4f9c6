"""Fault injection on the M6 example's command line: killed saves, signals, an unwritable run
directory and bad arguments. Subprocesses run the real CLI (`python examples/m6/train.py`)."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.m6 import train
from examples.m6.ckpt_io import complete_steps, load_latest
from examples.m6.config import get_config
from moe.checkpoint import checkpoint_dir

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


def _metadata(step_dir: Path) -> Path:
    """The metadata file of a step's checkpoint (its weights' index and the training state)."""
    return Path(checkpoint_dir(str(step_dir))) / "metadata.json"


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
        (["--eval-batch", "0"], "--eval-batch must be >= 1, got 0"),
        (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
        (["--threads", "-1"], "--threads must be between 0 (torch's default) and"),
        (["--log-every", "0"], "--log-every must be >= 1, got 0"),
        (["--eval-every", "0"], "--eval-every must be >= 1, got 0"),
        (["--ep", "0"], "--ep must be >= 1, got 0"),
        (["--device", "tpu"], "--device 'tpu' is unknown"),
        (["--spare-slots", "2147483647"], "--spare-slots 2147483647: at most 8 for 8 experts"),
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
    and --resume finishes the run with the losses of an uninterrupted one. The kill lands within
    0.3 s of the first step's line (a step takes ~0.2 s here), so 12 steps leave most of the
    run after it."""
    steps = "12"
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
    _metadata(steps[0][1]).write_text("{not json")  # the newest is damaged
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


def test_second_signal_exits_at_once_with_one_line(tmp_path):
    """Ctrl-C while the first stop request is being honoured: exit now, one line, no traceback.
    Two different signals, so the kernel cannot merge them into one pending signal."""
    proc = _start(tmp_path, "--steps", "400")
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), (proc.returncode, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: SIG") and " again: " in lines[0], err


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run directory holding one published step (step 2)."""
    run_dir = tmp_path_factory.mktemp("m6-saved")
    train.run(["--steps", "2", "--run-dir", str(run_dir), "--quiet", *FAST])
    return run_dir


def _damage(state: dict, field: str, value) -> None:
    *parents, leaf = field.split(".")
    for key in parents:
        state = state[key]
    if value is _DELETE:
        del state[leaf]
    else:
        state[leaf] = value


_DELETE = object()


@pytest.mark.parametrize(
    "field, value",
    [
        ("step", "abc"),
        ("config", _DELETE),
        ("vocab", 5),
        ("history", _DELETE),
        ("history.loss", "abc"),
        ("history.step", [1, "x"]),
        ("history.aux", [0.1]),
        ("rng", [999]),
    ],
)
def test_damaged_state_on_resume_is_one_line_naming_the_field(
    saved_run, tmp_path, capsys, field, value
):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    (step_dir,) = [p for _, p in complete_steps(run_dir / "checkpoint")]
    doc = json.loads(_metadata(step_dir).read_text())
    _damage(doc["objects"]["extra"], field, value)  # the training state saved with the step
    _metadata(step_dir).write_text(json.dumps(doc))
    argv = ["--steps", "4", "--run-dir", str(run_dir), "--resume", "--quiet", *FAST]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume: ") and "\n" not in err, err
    assert f"field {field!r}" in err, err


def test_nan_in_the_saved_training_state_is_refused_on_resume(saved_run, tmp_path, capsys):
    """Save refuses NaN in `extra`, so load does too (issue 32 item 8): before, the run
    resumed and failed at its next save with a traceback."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    (step_dir,) = [p for _, p in complete_steps(run_dir / "checkpoint")]
    doc = json.loads(_metadata(step_dir).read_text())
    doc["objects"]["extra"]["history"]["loss"][-1] = float("nan")
    _metadata(step_dir).write_text(json.dumps(doc))  # NaN, as Python's json writes it
    argv = ["--steps", "4", "--run-dir", str(run_dir), "--resume", "--quiet", *FAST]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume: ") and "\n" not in err, err
    assert "extra.history.loss[1] is NaN, not a finite number" in err, err


def _disk_full_after(nbytes: int):
    """A JsonStorageWriter.write_data that writes `nbytes` of the rank's file, then finds the
    disk full (ENOSPC), as a real full disk does part-way through a save."""
    import errno

    def write_data(self, plan, planner):
        with open(os.path.join(self.directory, f"data-{self.rank:05d}.bin"), "wb") as f:
            f.write(b"\0" * nbytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write_data


def _partial(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.name.startswith((".tmp-", ".probe-", "LATEST."))]


def test_a_full_disk_ends_the_save_with_one_error_and_nothing_partial(
    tmp_path, monkeypatch, capsys
):
    """Issue 49 item 10: ENOSPC in the middle of a save is one `error:` line (exit 1), no
    staging folder or probe file is left, the previous step stays loadable and --resume
    finishes the run once there is room again."""
    from moe.checkpoint import storage

    run = ["--run-dir", str(tmp_path), *FAST, "--quiet", "--steps", "4"]
    train.run([*run, "--stop-after", "2"])
    before = _metadata(complete_steps(tmp_path / "checkpoint")[0][1]).read_bytes()
    monkeypatch.setattr(storage.JsonStorageWriter, "write_data", _disk_full_after(100))
    capsys.readouterr()
    assert train.main([*run, "--resume"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: checkpoint step 4 not saved"), err
    assert "no space left on device (errno 28: ENOSPC)" in err and "is intact" in err, err
    assert "Traceback" not in err
    assert _partial(tmp_path) == []
    steps = complete_steps(tmp_path / "checkpoint")
    assert [s for s, _ in steps] == [2] and _metadata(steps[0][1]).read_bytes() == before
    step_dirs = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert step_dirs == ["step-00000002"], step_dirs  # no step-4 folder without a checkpoint
    monkeypatch.undo()
    assert train.run([*run, "--resume"])["steps"] == 4


def test_a_full_disk_at_the_run_dir_probe_leaves_no_probe_file(tmp_path, monkeypatch):
    import errno

    from examples.m6 import cli

    def full(self, text, *a, **k):
        open(self, "w").close()  # the file is created, its bytes find no room
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cli.Path, "write_text", full)
    with pytest.raises(train.UsageError, match="No space left on device"):
        cli.probe_run_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []
