"""bench/lora.py runs end to end at a tiny size and reports every candidate's columns
(structure only: no timing is asserted)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from bench import lora  # noqa: E402


def test_lora_bench_reports_every_candidate(monkeypatch, capsys):
    sizes = dict(lora.SIZES, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                 num_experts=4, head_dim=8, vocab_size=64)  # fmt: skip
    monkeypatch.setattr(lora, "SIZES", sizes)
    monkeypatch.setattr(lora, "SEQ", 16)
    result = lora.main(["--steps", "1", "--tokens", "32", "--rank", "2"])
    rows = result["rows"]
    assert list(rows) == ["moe full", "moe expert LoRA r=2", "PEFT LoRA (grouped_mm)",
                          "PEFT LoRA (eager)", "HF full"]  # fmt: skip
    E, d, F, layers = 4, 32, 16, 2
    assert rows["moe expert LoRA r=2"]["trainable_params"] == layers * E * 2 * 3 * (d + F)
    assert rows["PEFT LoRA (eager)"]["trainable_params"] == layers * E * (
        4 * (d + 2 * F) + 2 * (F + d)
    )  # gate_up_proj at rank 2r, down_proj at r
    assert rows["moe full"]["trainable_params"] == result["model_params"]
    for name, row in rows.items():
        assert row["step_ms"] > 0 and row["cpu_ms"] >= 0, name
        assert row["grad_bytes"] == row["trainable_bytes"], name  # every trainable has a grad
        assert row["optimizer_bytes"] == 2 * row["trainable_bytes"], name  # AdamW: 2 moments
    printed = capsys.readouterr().out
    assert (
        "| candidate | step ms (wall) | step ms (CPU) |" in printed
        and "PEFT LoRA (eager)" in printed
    )
