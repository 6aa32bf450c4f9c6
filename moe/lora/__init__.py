"""LoRA on the experts (issue 50): grouped low-rank adapters per expert on w1 / w3 / w2
(A [E, in, r], B [E, r, out], computed as grouped GEMMs on the dispatcher's sorted rows), and
optionally on the shared experts; they train under EP x FSDP2 and FP8 like the weights they
adapt. One setting chooses it, MoEConfig.lora, whose entries claim what they change: the
experts' weight format (LoRAFormat -> LoRAWeights), a kernel wrapper around whichever kernel
the layer resolved (LoRAKernel), and the router's logit term (moe/lora/linear.py). See
docs/lora.md."""

from moe.lora.apply import (
    adapter_parameters,
    adapter_state_dict,
    add_lora,
    is_adapter_name,
    merge,
)
from moe.lora.config import EXPERT_TARGETS, LoRAConfig
from moe.lora.format import LORA, LoRAFormat, LoRAWeights
from moe.lora.kernel import LORA_WRAPPER, LoRAKernel

__all__ = [
    "EXPERT_TARGETS",
    "LORA",
    "LORA_WRAPPER",
    "LoRAConfig",
    "LoRAFormat",
    "LoRAKernel",
    "LoRAWeights",
    "adapter_parameters",
    "adapter_state_dict",
    "add_lora",
    "is_adapter_name",
    "merge",
]
