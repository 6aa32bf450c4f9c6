"""The M6 example's run directory: a fresh run into a folder holding another run's checkpoints
moves them aside (never mixes, never deletes), --resume says the step it continues from, and
a resume with other settings names the setting that differs."""

import pytest

from examples.m6 import train
from examples.m6.ckpt_io import complete_steps

FAST = ["--no-plots", "--eval-every", "1000", "--global-batch", "32", "--steps", "5"]


def test_fresh_run_sets_old_checkpoints_aside_and_resume_names_its_step(tmp_path, capsys):
    run = ["--run-dir", str(tmp_path), *FAST]
    train.run([*run, "--stop-after", "4", "--quiet"])  # the older, longer run
    assert [s for s, _ in complete_steps(tmp_path / "checkpoint")] == [4]
    train.run([*run, "--stop-after", "2"])  # a fresh run into the same folder
    out = capsys.readouterr().out
    assert "held an earlier run's checkpoints (newest step 4)" in out, out
    assert [s for s, _ in complete_steps(tmp_path / "checkpoint")] == [2]
    assert [s for s, _ in complete_steps(tmp_path / "checkpoint.old-1")] == [4]  # kept
    resumed = train.run([*run, "--resume", "--stop-after", "3"])
    assert "resuming from step 2 " in capsys.readouterr().out
    assert resumed["steps_this_run"] == 1  # from the fresh run's step 2, not the old step 4
    with pytest.raises(train.UsageError, match=r"spare_slots: checkpoint 0, now 2") as e:
        train.run([*run, "--resume", "--spare-slots", "2", "--quiet"])
    assert "\n" not in str(e.value)
