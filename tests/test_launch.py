"""`python -m examples.launch` (torchrun's launcher without torchrun's traceback, issue 49
item 14): a rank's one-line error, then one line naming the failing rank, the rank's exit
status, and no traceback from either the ranks or the launcher."""

import os
import subprocess
import sys
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
