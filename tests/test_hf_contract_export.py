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


def test_hub_checkpoint_functions_name_the_contract_path(tmp_path):
    """save_hf_checkpoint knows the table families' hub names only: a contract-converted model
    is refused naming the layer and what to use instead."""
    model = moe.from_hf(tiny_model("glm4_moe"))
    with pytest.raises(moe.interop.HFCheckpointError, match=r"mlp.experts was converted through"):
        moe.save_hf_checkpoint(model, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
