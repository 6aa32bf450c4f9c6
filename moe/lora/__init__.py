"""LoRA on the experts (issue 50): grouped low-rank adapters per expert on w1 / w3 / w2
(A [E, in, r], B [E, r, out], computed as grouped GEMMs on the dispatcher's sorted rows), and
optionally on the shared experts; they train under EP x FSDP2 and FP8 like the weights they
adapt. See docs/lora.md."""

from moe.lora.apply import (
    adapter_parameters,
    adapter_state_dict,
    add_lora,
    is_adapter_name,
    merge,
)
from moe.lora.config import EXPERT_TARGETS, LoRAConfig
from moe.lora.format import LORA, LoRAFormat

__all__ = [
    "EXPERT_TARGETS",
    "LORA",
    "LoRAConfig",
    "LoRAFormat",
    "adapter_parameters",
    "adapter_state_dict",
    "add_lora",
    "is_adapter_name",
    "merge",
]
