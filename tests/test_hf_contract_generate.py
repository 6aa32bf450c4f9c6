"""Generation after export (greedy, a few tokens, float64): a contract family converted by
moe.from_hf generates transformers' own tokens, and so does the model to_hf gives back; with
LoRA, PEFT's PeftModel on the transformers model (the adapter from moe.interop.to_peft)
generates the tokens moe's LoRA model generates. A multimodal family's text path included."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it
peft = pytest.importorskip("peft")

import moe  # noqa: E402
from moe.interop import to_peft  # noqa: E402
from moe.lora import LoRAConfig, adapter_parameters, add_lora  # noqa: E402
from tests.hf_tiny import tiny_model  # noqa: E402

# shared experts + a dense layer; multimodal (text path); sigmoid router with a bias; the table
FAMILIES = ["glm4_moe", "qwen3_vl_moe", "minimax_m2", "qwen3_moe"]


def greedy(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_after_export(family, tmp_path):
    reference = tiny_model(family, torch.float64)
    with torch.no_grad():  # routers and weights away from their init
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(5))
    want = greedy(reference, ids)
    converted = moe.from_hf(copy.deepcopy(reference))
    assert torch.equal(greedy(converted, ids), want), family  # the KV cache through moe's layers
    assert torch.equal(greedy(moe.to_hf(converted), ids), want), family

    model = add_lora(moe.from_hf(copy.deepcopy(reference)), LoRAConfig(rank=2, alpha=3.0))
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.add_(torch.randn_like(p) * 0.5)
    ours = greedy(model, ids)
    to_peft(model, str(tmp_path), reference)
    theirs = greedy(peft.PeftModel.from_pretrained(copy.deepcopy(reference), str(tmp_path)), ids)
    assert torch.equal(theirs, ours), family
    assert not torch.equal(ours, want), family  # the adapters change what is generated
