"""`python -m examples.launch` (torchrun's launcher without torchrun's traceback, issue 49
item 14): a rank's one-line error, then one line naming the failing rank, the rank's exit
status, and no traceback from either the ranks or the launcher."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("examples/m6/train.py", ["--ep", "3"], "error: ep=3 does not divide the world size 2"),
        ("examples/hf/finetune.py", ["--ep", "3"], "error: --ep 3 must divide the 2 rank(s)"),
    ],
)
def test_a_failing_rank_is_its_error_line_and_status_without_traceback(
    tmp_path, script, argv, message
):
    pytest.importorskip("transformers") if "hf" in script else None
    out = ["--run-dir", str(tmp_path)] if "m6" in script else ["--out", str(tmp_path)]
    cmd = [sys.executable, "-m", "examples.launch", "--nproc-per-node", "2", script, *argv, *out]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    err = run.stderr
    assert run.returncode == 2, (run.returncode, err)
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: {script}: rank ") and "exited with status 2" in lines[-1]
    # every rank that got to report said the same one line (torchrun stops the others)
    errors = [line for line in lines[:-1] if "error:" in line]  # (argparse adds its usage)
    assert 1 <= len(errors) <= 2 and all(message in line for line in errors), err


@pytest.mark.parametrize("ranks", ["0", "-3", "99999", "two"])
def test_a_bad_rank_count_is_one_error_line_before_any_rank(tmp_path, ranks):
    """--nproc-per-node 0, -3, past the bound or not a number: one line, exit status 2,
    no rank started (issue 62 item 14)."""
    marker = tmp_path / "started"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    cmd = [sys.executable, "-m", "examples.launch", "--nproc-per-node", ranks, str(script)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.returncode, run.stderr)
    (line,) = [line for line in run.stderr.splitlines() if line.strip()]
    assert line.startswith("error: --nproc-per-node must be a number of ranks in [1, 1024]")
    assert repr(ranks) in line and not marker.exists()


def test_sigterm_stops_every_rank_with_one_line(tmp_path):
    """SIGTERM to the launcher: every rank stopped, one line, 128 + 15, no traceback."""
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()\n"
        "time.sleep(600)\n"
    )
    cmd = [sys.executable, "-m", "examples.launch", "--nproc-per-node", "2", str(script),
           str(tmp_path)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):  # both ranks running
        assert launcher.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, (launcher.returncode, err)
    assert "Traceback" not in err and "SignalException" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"error: {script}: stopped by SIGTERM; every rank was stopped"], err
