"""examples/hf/multimodal.py (a tiny Qwen3-VL-MoE converted by moe.from_hf, captioning
scikit-learn's digits) at a small size: it learns (held-out caption accuracy well above the
10 % chance, the loss falling), writes its plot, stops on SIGTERM with a checkpoint that
--resume continues exactly, and refuses bad flags with one line (exit status 2)."""

import os
import re
import signal

import pytest

pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it
pytest.importorskip("sklearn")  # the `examples` extra

from examples.hf import multimodal  # noqa: E402

FAST = ["--quiet", "--eval-every", "1000", "--save-every", "0"]


def _signalling(inner, call: int):
    """`inner` (multimodal.train_step) that sends this process SIGTERM during its `call`-th
    call (the loop's StopOnSignal takes it: the step finishes and is saved)."""
    calls = [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return inner(*args, **kwargs)

    return step


def _one_error_line(capsys, argv) -> str:
    code = multimodal.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (argv, code, err)
    return err[0]


def test_learns_resumes_exactly_and_refuses_bad_flags(tmp_path, capsys, monkeypatch):
    # 150 steps: well above chance, the plot written
    full = multimodal.run(["--out", str(tmp_path / "full"), "--steps", "150", *FAST])
    assert full["accuracy"] > 0.3, full["history"]["accuracy"]  # chance: 0.1
    assert full["history"]["accuracy"][0] < 0.2  # the random model at step 0: about chance
    assert sum(full["losses"][-10:]) < 0.2 * sum(full["losses"][:10])
    assert os.path.getsize(full["plot"]) > 10_000
    # SIGTERM during step 3 of 6: the step finishes, is saved, exit status 143, one line
    monkeypatch.setattr(multimodal, "train_step", _signalling(multimodal.train_step, 3))
    out = str(tmp_path / "stopped")
    code = multimodal.main(["--out", out, "--steps", "6", *FAST])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signal.SIGTERM, err
    assert len(err) == 1 and err[0].startswith("error: interrupted by SIGTERM after step 3;")
    monkeypatch.undo()
    # --resume continues from step 3: the losses of the run that was not stopped (its first 6
    # steps had the same learning rates: all within the 30 warm-up steps)
    resumed = multimodal.run(["--out", out, "--steps", "6", "--resume", *FAST])
    assert resumed["losses"] == full["losses"][:6]
    assert resumed["history"]["resume_step"] == [3]
    assert os.path.isfile(resumed["plot"])
    # a resume with other math, or without a checkpoint; bad flags: one line each, exit 2
    line = _one_error_line(capsys, ["--out", out, "--steps", "9", "--resume", "--batch", "16"])
    assert "--batch 32 there, 16 now" in line, line
    line = _one_error_line(capsys, ["--out", out, "--steps", "6", "--resume"])
    assert "pass --steps > it" in line, line
    line = _one_error_line(capsys, ["--out", str(tmp_path / "none"), "--resume"])
    assert "no complete checkpoint" in line, line
    (tmp_path / "file").write_text("")
    for argv, said in (
        (["--steps", "0"], "--steps must be >= 1"),
        (["--steps", "ten"], "--steps: invalid int value"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--stop-after", "600"], "--stop-after must be in (0, --steps=600)"),
        (["--save-every", "-1"], "--save-every must be >= 0"),
        (["--ep", "2"], "--ep 2 must divide the 1 rank(s)"),
        (["--threads", "999"], "--threads must be between 0"),
        (["--device", "tpu"], "--device 'tpu' is unknown"),
        (["--out", str(tmp_path / "file" / "run")], "exists and is not a directory"),
        (["--unknown"], "unrecognized arguments: --unknown"),
    ):
        assert said in _one_error_line(capsys, argv), argv


def test_a_damaged_training_state_is_refused_naming_the_field():
    """The checkpoint's state is read as untrusted JSON: each damage is one ValueError."""
    s = multimodal.Settings()
    good = {
        "step": 3,
        "history": {
            "step": [1, 2, 3],
            "loss": [3.7, 3.6, 3.5],
            "eval_step": [0],
            "accuracy": [0.0],
            "resume_step": [],
        },  # fmt: skip
        "schedule": {"lr": 3e-3, "warmup": 30, "steps": 600, "start": 0},
        "settings": {"batch": 32, "lr": 3e-3, "warmup": 30, "seed": 0},
    }
    multimodal.check_state(good, s)
    for change, said in (
        (lambda st: st.update(step="3"), "integer 'step'"),
        (lambda st: st["history"].update(loss=[3.7, "x", 3.5]), "history.loss must be a list"),
        (lambda st: st["history"].update(accuracy=True), "history.accuracy must be a list"),
        (lambda st: st["history"]["loss"].pop(), "history.loss must have one entry per step"),
        (lambda st: st["schedule"].update(lr=float("inf")), "'schedule.lr' must be a finite"),
        (lambda st: st["settings"].update(seed=1), "--seed 1 there, 0 now"),
        (lambda st: st.update(step=600), "pass --steps > it"),
    ):
        state = {k: (dict(v) if isinstance(v, dict) else v) for k, v in good.items()}
        state["history"] = {k: list(v) for k, v in good["history"].items()}
        change(state)
        with pytest.raises(ValueError, match=re.escape(said)):
            multimodal.check_state(state, s)
