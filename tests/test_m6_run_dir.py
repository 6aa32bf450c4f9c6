"""The M6 example's run directory: a fresh run into a folder holding another run moves the
whole earlier run aside (never mixes, never overwrites, never deletes), a folder in use by a
run is locked, --resume says the step it continues from and the learning-rate schedule it
follows, and a resume with other settings names the setting that differs."""

import fcntl
import json
import os

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
    assert "held an earlier run (newest checkpoint step 4)" in out, out
    assert [s for s, _ in complete_steps(tmp_path / "checkpoint")] == [2]
    assert [s for s, _ in complete_steps(tmp_path / "old-1" / "checkpoint")] == [4]  # kept
    resumed = train.run([*run, "--resume", "--stop-after", "3"])
    assert "resuming from step 2 " in capsys.readouterr().out
    assert resumed["steps_this_run"] == 1  # from the fresh run's step 2, not the old step 4
    with pytest.raises(train.UsageError, match=r"spare_slots: checkpoint 0, now 2") as e:
        train.run([*run, "--resume", "--spare-slots", "2", "--quiet"])
    assert "\n" not in str(e.value)


def test_loss_plot_names_every_line_and_marks_the_resume(tmp_path, monkeypatch):
    from examples.m6 import plots

    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    history = {"step": [1, 2, 3, 4], "loss": [4.0, 3.0, 2.5, 2.0], "aux": [0.03, 0.02] * 2,
               "drop": [0.3, 0.2, 0.1, 0.0], "eval_step": [4], "eval_loss": [2.2],
               "resume_step": [2], "title": "t"}  # fmt: skip
    plots.plot_loss(history, tmp_path / "loss.png")
    top, lower = figures[0].axes[:2]
    for ax, names in ((top, {"train loss", "held-out loss"}), (lower, {"aux (balance) loss"})):
        labels = {t.get_text() for t in ax.get_legend().get_texts()}
        assert names | {"resumed at step 2"} <= labels, labels
    assert any(t.get_text().startswith("dropped") for t in lower.get_legend().get_texts())


def test_a_wrong_sample_shows_the_true_caption():
    from examples.m6.report import sample_title

    wrong = {"correct": False, "generated": "a photo of the digit one", "label": "nine",
             "reference": "a photo of the digit nine"}  # fmt: skip
    assert sample_title(wrong).splitlines()[1] == "true [nine]: 'a photo of the digit nine'"
    assert sample_title({**wrong, "correct": True}) == "ok: 'a photo of the digit one'"


def _saved_lrs(run_dir):
    """The learning rates the run's newest checkpoint step recorded, one per step."""
    from moe.checkpoint.api import checkpoint_dir
    from moe.checkpoint.storage import read_metadata_json

    step, path = complete_steps(run_dir / "checkpoint")[0]
    extra = read_metadata_json(checkpoint_dir(str(path)))[1]["extra"]
    return extra["history"]["lr"]


def test_resume_with_another_total_keeps_the_learning_rate(tmp_path, capsys):
    """Issue 49 item 6: --resume --steps N with a larger N continues the checkpoint's schedule
    (no jump back up the cosine); --restart-schedule restarts it, and each says which."""
    run = ["--no-plots", "--eval-every", "1000", "--global-batch", "32", "--warmup", "1"]
    train.run(["--run-dir", str(tmp_path / "a"), *run, "--steps", "6", "--quiet"])
    capsys.readouterr()
    train.run(["--run-dir", str(tmp_path / "a"), *run, "--steps", "9", "--resume"])
    out = capsys.readouterr().out
    assert "continuing the checkpoint's schedule" in out and "--restart-schedule" in out, out
    lrs = _saved_lrs(tmp_path / "a")
    assert len(lrs) == 9
    floor = 0.1 * 3e-3
    assert lrs[6:] == pytest.approx([floor] * 3)  # the floor the 6-step cosine ends at
    assert all(b <= a + 1e-12 for a, b in zip(lrs, lrs[1:])), lrs
    train.run(["--run-dir", str(tmp_path / "b"), *run, "--steps", "6", "--quiet"])
    capsys.readouterr()
    train.run(["--run-dir", str(tmp_path / "b"), *run, "--steps", "9", "--resume",
               "--restart-schedule"])  # fmt: skip
    assert "schedule restarted at step 6" in capsys.readouterr().out
    lrs = _saved_lrs(tmp_path / "b")
    assert lrs[6] == pytest.approx(3e-3)  # a new warm-up (one step) to the peak
    with pytest.raises(train.UsageError, match="--restart-schedule needs --resume"):
        train.run(["--run-dir", str(tmp_path / "c"), *run, "--restart-schedule"])


def test_a_run_folder_in_use_is_one_clear_error(tmp_path):
    """Issue 49 item 8: a second run into a --run-dir that a live run holds is refused before
    it touches anything (the first run's checkpoint/ stays where it is)."""
    run = ["--run-dir", str(tmp_path), *FAST, "--quiet"]
    train.run([*run, "--stop-after", "2"])
    with open(tmp_path / ".m6-run.lock", "a+") as held:  # what a live run holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for extra in ([], ["--resume"]):
            with pytest.raises(train.UsageError, match="in use by another run") as e:
                train.run([*run, *extra])
            assert "\n" not in str(e.value)
        assert [s for s, _ in complete_steps(tmp_path / "checkpoint")] == [2]
        assert not (tmp_path / "old-1").exists()
    train.run([*run, "--resume"])  # released: the folder is usable again


def test_fresh_run_sets_the_whole_earlier_run_aside(tmp_path, capsys):
    """Issue 49 item 9: plots, summary.json, routing_trace.jsonl and checkpoint/ of the earlier
    run all move (nothing overwritten), and a dangling checkpoint.old-1 link moves as it is."""
    run = ["--run-dir", str(tmp_path), "--eval-every", "1000", "--global-batch", "32",
           "--steps", "3"]  # fmt: skip
    first = train.run(run)
    os.symlink(tmp_path / "nowhere", tmp_path / "checkpoint.old-1")  # dangling
    before = {
        p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name[0] != "."
    }
    assert {"summary.json", "routing_trace.jsonl", "loss.png"} <= set(before), before
    capsys.readouterr()
    train.run([*run, "--seed", "1"])
    assert "held an earlier run (newest checkpoint step 3)" in capsys.readouterr().out
    old = tmp_path / "old-1"
    assert {n: (old / n).read_bytes() for n in before} == before  # every file, unchanged
    assert os.readlink(old / "checkpoint.old-1") == str(tmp_path / "nowhere")
    assert [s for s, _ in complete_steps(old / "checkpoint")] == [3]
    new = json.loads((tmp_path / "summary.json").read_text())
    assert new["losses"] != first["losses"]  # the new run's own files beside old-1/
    (tmp_path / "notes.txt").write_text("mine")
    train.run([*run, "--quiet", "--no-plots"])
    assert (tmp_path / "old-2" / "notes.txt").read_text() == "mine"
    assert (old / "summary.json").read_bytes() == before["summary.json"]  # old-1 untouched


def test_a_fresh_run_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "thesis.tex").write_text("mine")
    with pytest.raises(train.UsageError, match="not an M6 run's"):
        train.run(["--run-dir", str(tmp_path), *FAST, "--quiet"])
    assert (tmp_path / "thesis.tex").read_text() == "mine"
