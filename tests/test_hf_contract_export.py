"""Families converted through the experts contract, trained, exported: one SGD step on the
converted model, then to_hf -> save_pretrained -> transformers' from_pretrained gives the same
logits as the trained converted model, and the same weights bit for bit."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

import moe  # noqa: E402
from tests.hf_tiny import relative_error, run, tiny_model  # noqa: E402

FAMILIES = ["qwen3_vl_moe", "glm4_moe", "minimax_m2"]  # multimodal; shared + dense; router bias


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_export_reloads_exactly(family, tmp_path):
    model = moe.from_hf(tiny_model(family))
    assert moe.moe_layers(model)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    run(model, ids)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    model.eval()
    want = model(input_ids=ids).logits
    exported = moe.to_hf(copy.deepcopy(model))
    exported.save_pretrained(tmp_path)
    reloaded = type(exported).from_pretrained(tmp_path).eval()
    reloaded.set_experts_implementation("eager")
    state = exported.state_dict()
    before = tiny_model(family).state_dict()
    assert any(not torch.equal(state[k], before[k]) for k in state if ".experts." in k), family
    for name, t in reloaded.state_dict().items():
        assert torch.equal(t, state[name]), (family, name)
    assert relative_error(reloaded(input_ids=ids).logits, want) <= 1e-5, family


# transposed (Aria), interleaved gate/up with biases (GPT-OSS), a post-expert norm (MuseSpark),
# multimodal (Qwen3-VL-MoE), shared experts + dense layers (GLM-4.5 MoE)
SAVED = ["aria", "gpt_oss", "muse_spark", "qwen3_vl_moe", "glm4_moe"]


@pytest.mark.parametrize("family", SAVED)
def test_save_hf_checkpoint_reloads_in_transformers(family, tmp_path):
    """save_hf_checkpoint writes a contract family under its experts modules' own names (read
    from the module, no per-family table): transformers' from_pretrained loads every tensor
    (to_hf's state dict, bit for bit) and computes the converted model's logits."""
    model = moe.from_hf(tiny_model(family))
    with torch.no_grad():  # weights (biases, norms) away from their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
    moe.save_hf_checkpoint(model, str(tmp_path))
    # MuseSpark's tiny config fails transformers' own validation when read back from JSON
    config = {"config": model.config} if family == "muse_spark" else {}
    reloaded = type(model).from_pretrained(tmp_path, **config).eval()
    reloaded.set_experts_implementation("eager")
    state = moe.to_hf(copy.deepcopy(model)).state_dict()
    got = reloaded.state_dict()
    assert got.keys() == state.keys(), family
    for name, t in got.items():
        assert torch.equal(t, state[name]), (family, name)
    assert relative_error(reloaded(input_ids=ids).logits, want) <= 1e-5, family


def test_load_hf_checkpoint_names_the_contract_path(tmp_path):
    """load_hf_checkpoint reads the table's hub names only: a contract-converted model is
    refused naming the layer and what to use instead, before anything is read."""
    model = moe.from_hf(tiny_model("glm4_moe"))
    with pytest.raises(moe.interop.HFCheckpointError, match=r"mlp.experts was converted through"):
        moe.load_hf_checkpoint(model, str(tmp_path))
