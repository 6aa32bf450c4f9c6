"""LoRA (moe.lora) on families converted through the experts contract: at init the model
equals transformers' (B = 0), every adapter gets a gradient, and merge -> to_hf -> transformers'
from_pretrained gives the LoRA model's logits. (PEFT export of these layers:
tests/test_hf_contract_peft.py.)"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

import moe  # noqa: E402
from moe.lora import LoRAConfig, adapter_parameters, add_lora, merge  # noqa: E402
from tests.hf_tiny import relative_error, run, tiny_model  # noqa: E402


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_vl_moe"])
def test_lora_trains_merges_and_exports(family, tmp_path):
    reference = tiny_model(family)
    model = add_lora(moe.from_hf(copy.deepcopy(reference)), LoRAConfig(rank=4, alpha=8))
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    want, got = run(reference, ids), run(model, ids)
    assert relative_error(got.logits, want.logits) <= 1e-5, family
    adapters = adapter_parameters(model)
    assert adapters and all(p.grad is not None and p.grad.any() for _, p in adapters[1::2])
    with torch.no_grad():
        for _, p in adapters:
            p += 0.05 * torch.randn_like(p)
    model.eval()
    adapted = model(input_ids=ids).logits
    assert relative_error(adapted, want.logits) > 1e-3  # the adapters change the function
    exported = moe.to_hf(merge(model))
    exported.save_pretrained(tmp_path)
    reloaded = type(exported).from_pretrained(tmp_path).eval()
    assert relative_error(reloaded(input_ids=ids).logits, adapted) <= 1e-5, family
