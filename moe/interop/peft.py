"""to_peft / from_peft: moe.lora's expert adapters <-> a PEFT adapter folder
(adapter_config.json + adapter_model.safetensors) for the original transformers model.

    model = AutoModelForCausalLM.from_pretrained(path)
    moe.from_hf(model); moe.lora.add_lora(model, LoRAConfig(rank=8, alpha=16))
    ...train...
    moe.interop.to_peft(model, "adapter")          # every rank calls it; rank 0 writes
    # transformers + PEFT: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path),
    #                                               "adapter") computes what `model` computes
    moe.interop.from_peft(model, "adapter")        # a PEFT-trained expert adapter read back

The adapter targets the fused expert parameters with PEFT's `target_parameters`
(`<block>.experts.gate_up_proj`, `<block>.experts.down_proj`, and `<block>.gate.weight` for
LoRAConfig(router=True)) and, for LoRAConfig(shared_experts=True), the shared experts'
nn.Linear weights (`<block>.shared_experts.gate_proj.weight`, ...: PEFT's LoRA on a 2-D
parameter, which is its plain nn.Linear LoRA; as `target_modules` PEFT's v4 -> v5 conversion
for DeepSeek-V3 took them for fused routed-expert projections and dropped them without a
word). moe/interop/peft_layout.py gives the exact mapping (gate and up share PEFT's A:
exported at rank 2r, block-diagonal B).
lora_dropout is written as 0: PEFT's parameter LoRA has no dropout (it is training-only).
Layers converted through transformers' experts contract (HFExpertsLayer) target their experts
module's own parameters (`<path>.gate_up_proj`, `.up_proj`, `.down_proj`): peft_contract.py.
"""

import json
import os

import torch
from torch import nn

from moe.interop import peft_contract
from moe.interop import peft_layout as L
from moe.interop.hf import HFMoELayer
from moe.interop.hf_contract import HFExpertsLayer
from moe.interop.peft_files import CONFIG, WEIGHTS


def _lora_layers(model: nn.Module, who: str) -> dict[str, HFMoELayer | HFExpertsLayer]:
    """path -> converted layer with expert adapters; an error when there is none."""
    layers = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, (HFMoELayer, HFExpertsLayer)) and getattr(m.config, "lora", None)
    }
    if not layers:
        raise ValueError(
            f"{who}: {type(model).__name__} has no MoE layer with expert LoRA: convert it with "
            "moe.from_hf(model), then moe.lora.add_lora(model, LoRAConfig(...))"
        )
    return layers


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole [S, ...] stack (a DTensor sharded by expert parallelism is gathered: every
    rank must call)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _factors(layer: HFMoELayer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """target -> (A, B) in canonical expert order [E, ...] (slot of each expert: its first)."""
    slot_E = layer.slot_of_expert_E
    out = {}
    for t in layer.config.lora.targets:
        a = getattr(layer.experts, f"lora_A_{t}", None)
        if a is not None:
            b = getattr(layer.experts, f"lora_B_{t}")
            out[t] = (_full(a.detach())[slot_E], _full(b.detach())[slot_E])
    return out


def _check_exportable(path: str, layer: HFMoELayer, first) -> None:
    c = layer.config.lora
    if first is not None and (c.rank, c.scale, c.targets, c.router) != (
        first.rank,
        first.scale,
        first.targets,
        first.router,
    ):
        raise ValueError(
            f"to_peft: {path} has LoRA rank {c.rank}, scale {c.scale}, targets {c.targets}; "
            f"another layer rank {first.rank}, scale {first.scale}, targets {first.targets} "
            "(one PEFT config holds one of each)"
        )


def _check_base(base, layers: dict[str, HFMoELayer]) -> str | None:
    """The transformers model or config the adapter is for: its experts must be the model's
    (count, widths). Returns its name_or_path."""
    if base is None:
        return None
    config = getattr(base, "config", base)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for path, layer in layers.items():
        if isinstance(layer, HFExpertsLayer):  # its own module's parameters, where base has them
            if isinstance(base, nn.Module):
                peft_contract.check_base(base, path, layer)
            continue
        hf = layer.hf_config
        for attr in ("hidden_size",):
            if getattr(hf, attr, None) != getattr(text, attr, None):
                raise ValueError(
                    f"to_peft: the base model's {attr}={getattr(text, attr, None)} is not "
                    f"{path}'s {getattr(hf, attr, None)} (an adapter for another model)"
                )
        if (layer.config.num_experts, layer.config.d_ff) != _experts_of(text, layer):
            raise ValueError(
                f"to_peft: the base model has (experts, d_ff) {_experts_of(text, layer)}, "
                f"{path} has {(layer.config.num_experts, layer.config.d_ff)} "
                "(an adapter for another model)"
            )
    return getattr(config, "_name_or_path", None) or None


def _experts_of(text_config, layer: HFMoELayer) -> tuple:
    from moe.interop.hf_families import FAMILIES

    family = FAMILIES[layer.hf_block_class.__name__]
    return getattr(text_config, family.num_experts, None), getattr(text_config, family.d_ff, None)


def to_peft(model: nn.Module, folder: str, base=None) -> dict:
    """Write the expert adapters of `model` (moe.from_hf + moe.lora.add_lora) as a PEFT adapter
    folder that `peft.PeftModel.from_pretrained(transformers_model, folder)` loads, computing
    the same function. `base`: the transformers model or config it is for (checked against
    the layers; its name_or_path recorded). Returns the adapter config written. Under expert
    parallelism every rank calls it (the adapters are gathered); rank 0 writes."""
    layers = _lora_layers(model, "to_peft")
    first = None
    for path, layer in layers.items():
        _check_exportable(path, layer, first)
        first = first or layer.config.lora
    name_or_path = _check_base(base, layers)
    targets = set(first.targets)
    has_gate_up, has_down = bool(targets & {"w1", "w3"}), "w2" in targets
    tensors, target_parameters = {}, []
    for path, layer in layers.items():
        f = _factors(layer)
        if isinstance(layer, HFExpertsLayer):  # the experts module's own parameters
            for name, factors in peft_contract.export(path, layer, f).items():
                tensors.update(factors)
                target_parameters.append(name)
            continue
        if has_gate_up:
            a, b = L.gate_up_to_peft(*f.get("w1", (None, None)), *f.get("w3", (None, None)))
            tensors[L.key(path, has_down, "A")], tensors[L.key(path, has_down, "B")] = a, b
            target_parameters.append(f"{path}.experts.{L.GATE_UP}")
        if has_down:
            a, b = L.down_to_peft(*f["w2"])
            tensors[L.key(path, False, "A")], tensors[L.key(path, False, "B")] = a, b
            target_parameters.append(f"{path}.experts.{L.DOWN}")
        if first.router:  # lora_A [r, d], lora_B [E, r]: PEFT's 2-D parameter LoRA exactly
            tensors[L.router_key(path, "A")] = _full(layer.router.lora_A.detach())
            tensors[L.router_key(path, "B")] = _full(layer.router.lora_B.detach())
            target_parameters.append(f"{path}.{L.ROUTER}")
        for name, linear in L.shared_modules(path, layer):  # lora_A [r, in], lora_B [out, r]
            tensors[L.module_key(name, "A")] = _full(linear.lora_A.detach())
            tensors[L.module_key(name, "B")] = _full(linear.lora_B.detach())
            target_parameters.append(f"{name}.weight")
    peft_contract.check_renamings(model, tensors)
    both = {"w1", "w3"} <= targets
    gate_up_rank = first.rank * (2 if both else 1)
    r = first.rank if has_down or first.router else gate_up_rank
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "r": r,
        "lora_alpha": first.alpha * (r // first.rank),  # PEFT's lora_alpha / r = alpha / rank
        "lora_dropout": 0.0,
        "target_modules": [],
        "target_parameters": sorted(target_parameters),
        "rank_pattern": {L.GATE_UP: gate_up_rank} if has_gate_up and gate_up_rank != r else {},
        "alpha_pattern": (
            {L.GATE_UP: first.alpha * 2} if has_gate_up and gate_up_rank != r else {}
        ),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": name_or_path,
        "auto_mapping": {
            "base_model_class": L.model_class(model).__name__,
            "parent_library": L.model_class(model).__module__,
        },
    }
    if _rank() == 0:
        _write(folder, config, tensors)
    return config


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _write(folder: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Both files, each written beside its final name then renamed into place."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{WEIGHTS}.tmp")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp, {"format": "pt"})
    os.replace(tmp, os.path.join(folder, WEIGHTS))
    tmp = os.path.join(folder, f".{CONFIG}.tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(folder, CONFIG))
