"""examples/hf/lora.py runs end to end with tiny settings (Qwen3-MoE and Mixtral): the PEFT
adapter it saves makes transformers + PEFT generate moe's greedy tokens; bad flags fail
before any work."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from examples.hf import lora  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_lora_example_same_tokens(tmp_path, capsys, monkeypatch, family):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = lora.main(["--family", family, "--steps", "3", "--out", str(tmp_path / "a")])
    assert out["same_tokens"] and out["ours"] == out["theirs"], out
    assert out["final_loss"] < out["first_loss"], out
    assert (tmp_path / "a" / "adapter_config.json").is_file()
    printed = capsys.readouterr().out
    assert printed.count("settings: ") == 1 and "expert LoRA rank 8 alpha 16" in printed
    assert "same tokens from transformers + PEFT: yes" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rank", "0"], "--rank and --log-every must be >= 1"),
        (["--alpha", "nan"], "--alpha must be a finite number > 0, got nan"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--ep", "2"], "--ep 2 must divide the 1 rank(s)"),
        (["--family", "olmoe"], "invalid choice"),
        (["--out", "{file}"], "exists and is not a directory"),
    ],
)
def test_bad_flags_fail_before_any_work(argv, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("mine")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def no_work(*_):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(lora, "tiny", no_work)
    with pytest.raises(SystemExit) as exit_:
        lora.main([*argv, "--steps", "2", "--quiet"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"
