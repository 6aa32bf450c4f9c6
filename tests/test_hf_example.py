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
