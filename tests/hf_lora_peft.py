"""One family's LoRA -> PEFT check (tests/test_hf_contract_peft.py and the support table's
LoRA-PEFT column): its tiny model converted by moe.from_hf, LoRA added on every expert
projection with adapters far from zero, exported by moe.interop.to_peft, loaded by PEFT's own
peft.PeftModel.from_pretrained on the transformers model, and read back by from_peft.

    r = check_lora_peft("glm4_moe")
    r.refusal            # None, or the one error (from_hf, add_lora, to_peft) that refused it
    r.error              # PEFT's logits against moe's LoRA model, relative (Frobenius norms)
    r.tol                # what r.error must stay under: float64 1e-10, float32 1e-5
"""

import copy
import tempfile
from dataclasses import dataclass

import torch

import moe
from moe.interop import from_peft, peft_lora_config, to_peft
from moe.lora import LoRAConfig, adapter_parameters, add_lora
from tests.hf_matrix import SETTINGS, TABLE_TOL, TOL
from tests.hf_tiny import relative_error, tiny_model

LORA = LoRAConfig(rank=2, alpha=3.0)


@dataclass
class PeftCheck:
    family: str
    dtype: torch.dtype
    tol: float
    refusal: str | None = None
    error: float | None = None  # PEFT's logits vs moe's LoRA model, relative
    changed: float | None = None  # how far the adapter moves moe's logits, relative
    read_back: float | None = None  # from_peft into a fresh converted model vs moe's, relative
    all_loaded: bool | None = None  # every lora_B PEFT holds is the file's (none left zero)
    targets: tuple = ()  # adapter_config.json's target_parameters

    @property
    def passed(self) -> bool:
        big = self.changed is not None and self.changed > 1e-3
        within = max(self.error or 0.0, self.read_back or 0.0) <= self.tol
        return self.refusal is None and big and within and bool(self.all_loaded)


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def check_lora_peft(family: str) -> PeftCheck:
    import peft

    dtype, tol = SETTINGS.get(family, (torch.float64, TOL))
    tol = tol if dtype == torch.float64 else max(tol, 1e-5)
    result = PeftCheck(family, dtype, tol)
    reference = tiny_model(family, dtype)
    with torch.no_grad():  # routers and weights away from their init
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    with tempfile.TemporaryDirectory() as folder:
        try:
            model = add_lora(moe.from_hf(copy.deepcopy(reference)), LORA)
            with torch.no_grad():  # adapters far from zero (each expert's copies alike)
                for n, p in adapter_parameters(model):
                    layer = model.get_submodule(n.rpartition(".experts.")[0])
                    p.add_(torch.randn_like(p[layer.slot_of_expert_E])[layer.expert_of_slot()])
            result.targets = tuple(to_peft(model, folder, reference)["target_parameters"])
            if moe.interop.hf_blocks(reference):  # the table's routers compute in float32
                result.tol = max(tol, TABLE_TOL)
        except ValueError as e:
            result.refusal = str(e)
            return result
        ours = _logits(model, ids)
        result.changed = relative_error(ours, _logits(reference, ids))
        theirs = peft.PeftModel.from_pretrained(copy.deepcopy(reference), folder)
        result.error = relative_error(_logits(theirs, ids), ours)
        b = [m for n, m in theirs.named_parameters() if "lora_B" in n]
        result.all_loaded = bool(b) and all(bool(m.any()) for m in b)  # PEFT's init: B = 0
        again = add_lora(
            moe.from_hf(copy.deepcopy(reference)), LoRAConfig(**peft_lora_config(folder))
        )
        from_peft(again, folder)
        result.read_back = relative_error(_logits(again, ids), ours)
    return result
