"""The Hugging Face fine-tuning example runs end to end with tiny settings: the loss falls and
transformers reloads the saved checkpoint with the same logits."""

import pytest

pytest.importorskip("transformers")

from examples.hf import finetune  # noqa: E402


def test_finetune_example(tmp_path):
    out = finetune.main(["--steps", "40", "--out", str(tmp_path / "out"), "--quiet"])
    assert out["final_loss"] < 0.7 * out["first_loss"], out
    assert out["max_logit_diff"] <= 1e-5
    assert (tmp_path / "out" / "config.json").is_file()


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
