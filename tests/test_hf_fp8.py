"""moe.from_hf(model, fp8=FP8Config(...)): every converted layer (a table family's, a contract
family's, a quirk family's, a multimodal model's) runs moe's FP8 experts, and the logits'
error is the support table's FP8 figure (tests/data/hf_support.json)."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import moe  # noqa: E402
from moe.fp8 import FP8Config  # noqa: E402
from tests.hf_matrix import agrees, fp8_error, support  # noqa: E402
from tests.hf_tiny import tiny_model  # noqa: E402

FAMILIES = ["mixtral", "gpt_oss", "qwen3_vl_moe"]  # table, quirks, multimodal


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_fp8_sets_every_layer_and_trains(family):
    fp8 = FP8Config(experts=True)
    model = moe.from_hf(tiny_model(family, torch.float32), fp8=fp8)
    layers = [m for m in model.modules() if isinstance(m, moe.MoELayer)]
    assert layers and all(layer.config.fp8 == fp8 for layer in layers)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.square().mean().backward()
    grads = [layer.experts.w1.grad for layer in layers]
    assert all(g is not None and g.isfinite().all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_error_is_the_tables(family):
    error = fp8_error(family)
    # e4m3 moves the logits (above float32 rounding: FP8 ran), within the table's figure
    assert 1e-5 < error < 0.1 and agrees(error, support()[family]["fp8"])
