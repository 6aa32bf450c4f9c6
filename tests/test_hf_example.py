"""The Hugging Face fine-tuning example runs end to end with tiny settings: the loss falls and
transformers reloads the saved checkpoint with the same logits."""

import pytest

pytest.importorskip("transformers")

from examples.hf import finetune  # noqa: E402


def test_finetune_example(tmp_path, capsys):
    """Issue 49 items 15, 18: the settings line is printed once; the logit difference the
    README promises (0.00e+00) is the reload against our weights in transformers' own blocks,
    and moe's layers differ from those by float32 rounding only."""
    out = finetune.main(["--steps", "40", "--out", str(tmp_path / "out")])
    assert out["final_loss"] < 0.7 * out["first_loss"], out
    assert out["max_logit_diff"] <= 1e-5
    assert out["max_logit_diff_same_code"] == 0.0
    assert (tmp_path / "out" / "config.json").is_file()
    printed = capsys.readouterr().out
    assert printed.count("settings: ") == 1
    assert "settings: fp32, FP8 off, dp 1 x ep 1 (1 rank), offload none" in printed, printed
    assert "max |logit difference| 0.00e+00 against our weights in transformers' blocks" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ep", "0"], "--ep must be >= 1, got 0"),
        (["--ep", "-1"], "--ep must be >= 1, got -1"),
        (["--ep", "2"], "--ep 2 must divide the 1 rank(s)"),
        (["--out", "{file}"], "exists and is not a directory"),
        (["--out", "{file}/sub/dir"], "exists and is not a directory"),
        (["--model", "{missing}"], "not a directory"),
        (["--lr", "inf"], "error: --lr must be a finite number > 0, got inf"),  # issue 41 item 14
        (["--lr", "nan"], "error: --lr must be a finite number > 0, got nan"),
        (["--lr", "-0.1"], "error: --lr must be a finite number > 0, got -0.1"),
        (["--threads", "-1"], "--threads must be between 0 (torch's default) and"),
        (["--threads", "100000"], "this process's share of the cores), got 100000"),
    ],
)
def test_bad_flags_fail_before_any_work(argv, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("mine")
    paths = {"file": tmp_path / "file", "missing": tmp_path / "missing"}
    argv = [a.format(**paths) for a in argv]
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def no_work():
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(finetune, "tiny_qwen3_moe", no_work)
    with pytest.raises(SystemExit) as exit_:
        finetune.main([*argv, "--steps", "2", "--quiet"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"
