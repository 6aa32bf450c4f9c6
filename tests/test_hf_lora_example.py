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


def _fresh_process_snippet() -> str:
    """examples/hf/README.md's snippet that loads the example's adapter in a new process."""
    from tests.docs_blocks import blocks

    (code,) = [c for c in blocks("examples/hf/README.md", "python") if "AutoPeftModel" in c]
    return code


def test_the_adapter_loads_in_a_fresh_process_with_peft_and_moe(tmp_path, monkeypatch):
    """The default run saves its tiny base (runs/hf-lora/base) and the adapter records it, so
    the README's snippet, run as a file by a new python from another directory, loads the
    adapter with PEFT (AutoPeftModelForCausalLM: the base found from the adapter) and into
    moe's layers, and both compute the example's function."""
    import json
    import os
    import subprocess
    import sys

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    out = lora.main(["--steps", "3", "--quiet"])
    config = json.loads((tmp_path / "runs/hf-lora/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "runs/hf-lora/base")
    script = tmp_path / "snippet.py"
    script.write_text(_fresh_process_snippet())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "runs").symlink_to(tmp_path / "runs")  # the snippet's relative folder
    done = subprocess.run([sys.executable, str(script)], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert json.loads(printed["PEFT greedy"]) == out["theirs"][0], (printed, out)
    assert json.loads(printed["moe greedy"]) == out["ours"][0], (printed, out)
    assert float(printed["max |logit difference|"]) < 1e-4
