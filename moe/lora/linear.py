"""Plain per-matrix LoRA on a dense weight W [out, in] (the shared experts' nn.Linear layers and
the router's scorer): parameters lora_A [r, in] and lora_B [out, r] on the module (PEFT's
shapes) and a term scale * dropout(x) A^T B^T added to its output (a forward hook on an
nn.Linear; on the router, whose logits are fp32, its generic hook Router.logit_term). The
module's own keys (weight, bias) stay as they are, so checkpoints and export read the base
weights unchanged."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moe.lora import kernel
from moe.lora.config import LoRAConfig
from moe.lora.format import check_rank, init_lora_A


class DenseAdapter:
    """scale * dropout(x) @ lora_A^T @ lora_B^T of `module` (dropout in training), in
    `dtype` math (None: the adapters' dtype): the term added to its output."""

    def __init__(self, scale: float, dropout: float, fp32: bool = False):
        self.scale, self.dropout, self.fp32 = scale, dropout, fp32

    def term(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        a, b = module.lora_A, module.lora_B
        dtype = torch.promote_types(a.dtype, torch.float32) if self.fp32 else a.dtype
        x = kernel.adapter_dropout(x, self.dropout if module.training else 0.0)
        return F.linear(F.linear(x.to(dtype), a.to(dtype)), b.to(dtype)) * self.scale

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Router.logit_term's form: the term itself."""
        return self.term(module, x)


class _LinearHook(DenseAdapter):
    """As an nn.Linear forward hook: y + the term, in y's dtype."""

    def __call__(self, module: nn.Module, args, y: torch.Tensor) -> torch.Tensor:
        return y + self.term(module, args[0]).to(y.dtype)


def _add_adapter_params(module: nn.Module, weight: torch.Tensor, config: LoRAConfig, where: str):
    out_f, in_f = weight.shape
    check_rank(config, (in_f, out_f), where)
    kw = {"device": weight.device, "dtype": weight.dtype}
    a = nn.Parameter(torch.empty(config.rank, in_f, **kw))
    init_lora_A(a.data.t())  # [in, r]: dim -2 is `in`, as for the experts' A
    module.lora_A = a
    module.lora_B = nn.Parameter(torch.zeros(out_f, config.rank, **kw))


def add_linear_adapter(linear: nn.Linear, config: LoRAConfig, where: str) -> None:
    """lora_A (PEFT's kaiming-uniform), lora_B = 0 and the hook, on `linear` (frozen)."""
    _add_adapter_params(linear, linear.weight, config, where)
    hook = _LinearHook(config.scale, config.dropout)
    linear.lora_hook = linear.register_forward_hook(hook)


def add_router_adapter(router: nn.Module, config: LoRAConfig, where: str) -> None:
    """lora_A [r, D], lora_B [E, r] on the router, its logits + the term (fp32 math)."""
    _add_adapter_params(router, router.weight, config, where)
    router.logit_term = DenseAdapter(config.scale, config.dropout, fp32=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def _fold(module: nn.Module, scale: float) -> None:
    """weight += scale * B A (on this rank's shard of a sharded weight)."""
    w = module.weight
    dtype = torch.promote_types(w.dtype, torch.float32)
    delta = (_full(module.lora_B).to(dtype) @ _full(module.lora_A).to(dtype)) * scale
    if isinstance(w, DTensor):
        delta = distribute_tensor(delta.to(w.dtype), w.device_mesh, w.placements)
    w.add_(delta.to(w.dtype))
    del module.lora_A, module.lora_B


def merge_linear_adapter(linear: nn.Linear) -> None:
    """weight += scale * B A; the adapter and its hook removed."""
    hook = linear.lora_hook
    _fold(linear, linear._forward_hooks[hook.id].scale)
    hook.remove()
    del linear.lora_hook


def merge_router_adapter(router: nn.Module) -> None:
    _fold(router, router.logit_term.scale)
    del router.logit_term  # back to the class attribute: None
