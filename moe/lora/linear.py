"""Plain per-matrix LoRA on an nn.Linear (the shared experts' projections): parameters
lora_A [r, in] and lora_B [out, r] on the module (PEFT's shapes), and a forward hook that adds
scale * dropout(x) A^T B^T to its output. The module's own keys (weight, bias) stay as they
are, so checkpoints and export read the base weights unchanged."""

import torch
import torch.nn.functional as F
from torch import nn

from moe.lora.config import LoRAConfig
from moe.lora.format import check_rank, init_lora_A


class _LinearAdapterHook:
    """The forward hook: y + scale * dropout(x) @ lora_A^T @ lora_B^T (dropout in training)."""

    def __init__(self, scale: float, dropout: float):
        self.scale, self.dropout = scale, dropout

    def __call__(self, module: nn.Linear, args, y: torch.Tensor) -> torch.Tensor:
        x = F.dropout(args[0], self.dropout, training=module.training and self.dropout > 0)
        a, b = module.lora_A, module.lora_B
        return y + (F.linear(F.linear(x.to(a.dtype), a), b) * self.scale).to(y.dtype)


def add_linear_adapter(linear: nn.Linear, config: LoRAConfig, where: str) -> None:
    """lora_A (PEFT's kaiming-uniform), lora_B = 0 and the hook, on `linear` (frozen)."""
    out_f, in_f = linear.weight.shape
    check_rank(config, (in_f, out_f), where)
    kw = {"device": linear.weight.device, "dtype": linear.weight.dtype}
    a = nn.Parameter(torch.empty(config.rank, in_f, **kw))
    with torch.no_grad():  # [r, in]: dim -2 of its transpose is `in`
        init_lora_A(a.data.t())
    linear.lora_A = a
    linear.lora_B = nn.Parameter(torch.zeros(out_f, config.rank, **kw))
    linear.lora_hook = linear.register_forward_hook(
        _LinearAdapterHook(config.scale, config.dropout)
    )


def merge_linear_adapter(linear: nn.Linear) -> None:
    """weight += scale * B A; the adapter and its hook removed."""
    hook = linear.lora_hook
    scale = linear._forward_hooks[hook.id].scale
    with torch.no_grad():
        delta = (linear.lora_B.float() @ linear.lora_A.float()) * scale
        linear.weight.add_(delta.to(linear.weight.dtype))
    hook.remove()
    del linear.lora_A, linear.lora_B, linear.lora_hook
