"""add_lora / merge / adapter_state_dict: LoRA on a model's MoE layers, from outside the model
(before moe.parallel.parallelize, as every other feature)."""

import torch
from torch import nn

from moe.kernels.registry import kernel_wrappers_for
from moe.kernels.weight_format import weight_format_for
from moe.layer import MoELayer
from moe.lora.config import LoRAConfig
from moe.lora.format import PREFIXES, check_rank, projection_shape
from moe.lora.linear import (
    add_linear_adapter,
    add_router_adapter,
    merge_linear_adapter,
    merge_router_adapter,
)
from moe.shards import local


def _layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(n or "model", m) for n, m in model.named_modules() if isinstance(m, MoELayer)]


def _shared_linears(layer: MoELayer) -> list[tuple[str, nn.Linear]]:
    shared = layer.shared_experts
    if shared is None:
        return []
    return [
        (n, getattr(shared, n))
        for n in ("gate_proj", "up_proj", "down_proj")
        if getattr(shared, n, None) is not None
    ]


def _check(model: nn.Module, config: LoRAConfig) -> list[tuple[str, MoELayer]]:
    """Every refusal before any change: the model, each layer, each matrix's rank."""
    if not isinstance(config, LoRAConfig):
        raise TypeError(f"add_lora takes a moe.lora.LoRAConfig, got {type(config).__name__}")
    layers = _layers(model)
    if not layers:
        raise ValueError("add_lora: the model has no moe.MoELayer to adapt")
    matched = 0
    for name, layer in layers:
        if layer.mesh is not None:
            raise ValueError(f"{name}: call add_lora before moe.parallel.parallelize")
        if layer.config.lora is not None:
            raise ValueError(f"{name}: already has LoRA adapters (rank {layer.config.lora.rank})")
        if layer.config.weight_format != "dense":
            raise ValueError(
                f"{name}: LoRA adapts dense expert weights, this layer has "
                f"weight_format={layer.config.weight_format!r}"
            )
        try:  # a format another feature claims (the two cannot both store the experts)
            weight_format_for(layer.config.replace(lora=config))
        except ValueError as e:
            raise ValueError(f"{name}: LoRA cannot adapt this layer: {e}") from None
        for t in config.targets:
            shape = projection_shape(layer.experts, t)
            if shape is not None:
                check_rank(config, shape, f"{name}.experts.{t}")
                matched += 1
        if config.router:
            if not isinstance(layer.router.weight, torch.Tensor):
                raise ValueError(f"LoRAConfig.router=True: {name}.router has no weight to adapt")
            check_rank(config, tuple(layer.router.weight.shape[::-1]), f"{name}.router")
        if config.shared_experts:
            if layer.shared_experts is None:
                raise ValueError(f"LoRAConfig.shared_experts=True: {name} has no shared experts")
            for n, lin in _shared_linears(layer):
                check_rank(config, tuple(lin.weight.shape[::-1]), f"{name}.shared_experts.{n}")
    if not matched:
        raise ValueError(
            f"LoRAConfig.targets={config.targets} match no expert projection (a gelu/relu "
            "layer has no w3)"
        )
    return layers


def add_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Freeze every parameter of `model` and add low-rank adapters to each MoELayer's experts
    (config.targets of w1, w2, w3; A kaiming-uniform, B zero: the output is unchanged), and to
    the router / shared experts when asked. In place; returns model. Call before parallelize."""
    layers = _check(model, config)
    for p in model.parameters():
        p.requires_grad_(False)
    for _, layer in layers:
        _set_lora(layer, config)
        layer.experts.weight_format.setup(layer.experts)
        with torch.no_grad():  # spare slots (replicas) hold their expert's adapters
            for n, p in layer.experts.named_parameters(recurse=False):
                if n.startswith(PREFIXES):
                    p.copy_(p[layer.expert_of_slot_S.to(p.device)])
        if config.shared_experts:
            for n, lin in _shared_linears(layer):
                add_linear_adapter(lin, config, f"shared_experts.{n}")
        if config.router:
            add_router_adapter(layer.router, config, "router")
    return model


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict key is an adapter's (lora_A..., lora_B...)."""
    return name.rpartition(".")[2].startswith(("lora_A", "lora_B"))


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' parameters by name (what an optimizer of a LoRA run takes)."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_name(n)]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only, by state-dict key (DTensors stay DTensors under parallelize)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_name(k)}


def _fold(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, name: str) -> None:
    """w += scale * a @ b per expert, on this rank's shards (equal placements on dim 0)."""
    pa, pw = getattr(a, "placements", None), getattr(w, "placements", None)
    if pa != pw or local(a).shape[0] != local(w).shape[0]:
        raise ValueError(f"merge: {name} and its adapters are sharded differently")
    wl, al, bl = local(w), local(a), local(b)
    dtype = torch.promote_types(wl.dtype, torch.float32)
    wl.add_((torch.bmm(al.to(dtype), bl.to(dtype)) * scale).to(wl.dtype))


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += alpha / r * A B) and remove the adapters:
    the layers go back to plain dense weights (to_hf then writes a merged checkpoint). The
    base weights stay frozen. In place; returns model."""
    for name, layer in _layers(model):
        lora = layer.config.lora
        if lora is None:
            continue
        experts = layer.experts
        with torch.no_grad():
            for t in lora.targets:
                a = getattr(experts, f"lora_A_{t}", None)
                if a is None:
                    continue
                b = getattr(experts, f"lora_B_{t}")
                _fold(getattr(experts, t).data, a.data, b.data, lora.scale, f"{name}.{t}")
                delattr(experts, f"lora_A_{t}")
                delattr(experts, f"lora_B_{t}")
        for _, lin in _shared_linears(layer):
            if hasattr(lin, "lora_A"):
                merge_linear_adapter(lin)
        if hasattr(layer.router, "lora_A"):
            merge_router_adapter(layer.router)
        _set_lora(layer, None)
    return model


def _set_lora(layer: MoELayer, config: LoRAConfig | None) -> None:
    """The layer's one LoRA setting (MoEConfig.lora) and what it claims: the experts' weight
    format and the kernel wrapper around their kernel."""
    layer.config = layer.config.replace(lora=config)
    layer.experts.weight_format = weight_format_for(layer.config)
    layer.experts.wrappers = kernel_wrappers_for(layer.config)
