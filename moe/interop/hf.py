"""from_hf / to_hf: transformers' sparse-MoE blocks <-> moe layers, in place, weights copied.

    model = AutoModelForCausalLM.from_pretrained(...)   # any family on the experts contract
    moe.from_hf(model)           # the table's blocks -> HFMoELayer, every other experts module on
                                 # the contract -> HFExpertsLayer (hf_contract.py); same function
    moe.parallel.parallelize(model, mesh)  # as for any model with MoE layers
    ...train...
    moe.to_hf(model).save_pretrained(path)  # the original block classes, trained weights

The table's families (hf_families.py: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3) convert whole;
their converted block state-dict names (under the block's path, e.g. `model.layers.3.mlp.`):
    router.weight [E, d]                        <- gate.weight
    router.expert_bias [E]                      <- gate.e_score_correction_bias (DeepSeek-V3)
    experts.w1 / experts.w3 [E, d, F]           <- experts.gate_up_proj[:, :F] / [:, F:], transposed
    experts.w2 [E, F, d]                        <- experts.down_proj, transposed
    shared_experts.{gate,up,down}_proj.weight   <- shared_expert(s).{gate,up,down}_proj.weight
    shared_experts.gate.weight [1, d]           <- shared_expert_gate.weight (Qwen2-MoE)
transformers is imported by neither function: they work on the modules they are given.
"""

import weakref

import torch
from torch import nn

from moe.interop import hf_contract
from moe.interop.hf_families import FAMILIES
from moe.layer import MoELayer


class HFMoELayer(MoELayer):
    """An MoELayer standing in for a transformers sparse-MoE block: it remembers the block's
    class and config so `to_hf` can rebuild it, and applies Mixtral's input jitter."""

    def __init__(self, block_class: type, hf_config, jitter: float = 0.0, **options):
        super().__init__(**options)
        self.hf_block_class, self.hf_config, self.jitter = block_class, hf_config, jitter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter > 0:  # Mixtral: experts and router see the jitter
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        return super().forward(x)


def _shared_block(block: nn.Module) -> nn.Module | None:
    return getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), attr


@torch.no_grad()
def _copy_in(layer: HFMoELayer, block: nn.Module) -> None:
    F = layer.config.d_ff
    gate_up_EXD, down_EDF = block.experts.gate_up_proj, block.experts.down_proj
    layer.router.weight.copy_(block.gate.weight)
    slot_S = layer.expert_of_slot()  # every slot takes its expert (spare slots: a copy)
    layer.experts.w1.copy_(gate_up_EXD[:, :F].transpose(1, 2)[slot_S])
    layer.experts.w3.copy_(gate_up_EXD[:, F:].transpose(1, 2)[slot_S])
    layer.experts.w2.copy_(down_EDF.transpose(1, 2)[slot_S])
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is not None:
        layer.router.expert_bias.copy_(bias)
    shared = _shared_block(block)
    if shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.shared_experts, name).weight.copy_(getattr(shared, name).weight)
    if getattr(block, "shared_expert_gate", None) is not None:
        layer.shared_experts.gate.weight.copy_(block.shared_expert_gate.weight)


@torch.no_grad()
def _copy_out(block: nn.Module, layer: HFMoELayer) -> None:
    slot_E = layer.slot_of_expert_E  # canonical order (rebalance_experts; replicas: first copy)
    w1, w2, w3 = (w[slot_E] for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3))
    block.experts.gate_up_proj.copy_(torch.cat([w1, w3], dim=2).transpose(1, 2))
    block.experts.down_proj.copy_(w2.transpose(1, 2))
    block.gate.weight.copy_(layer.router.weight)
    if getattr(block.gate, "e_score_correction_bias", None) is not None:
        block.gate.e_score_correction_bias.copy_(layer.router.expert_bias)
    shared = _shared_block(block)
    if shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(shared, name).weight.copy_(getattr(layer.shared_experts, name).weight)
    if getattr(block, "shared_expert_gate", None) is not None:
        block.shared_expert_gate.weight.copy_(layer.shared_experts.gate.weight)


def hf_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every transformers sparse-MoE block of a supported family."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in FAMILIES]


def _check_supported(model: nn.Module) -> None:
    """Modules that look like sparse-MoE blocks (a router `gate` and fused `experts`) but
    belong to no supported family are an error naming the path and class."""
    for name, module in model.named_modules():
        cls = type(module).__name__
        experts = getattr(module, "experts", None)
        looks_sparse = hasattr(module, "gate") and hasattr(experts, "gate_up_proj")
        if looks_sparse and cls not in FAMILIES and not hf_contract.on_contract(experts):
            raise ValueError(
                f"from_hf: {name} ({cls}) is a sparse-MoE block of an unsupported family; "
                f"supported: {sorted(FAMILIES)}"
            )


def from_hf(model: nn.Module, *, spare_slots: int = 0, fp8=None) -> nn.Module:
    """Replace every sparse-MoE block of a transformers model with an HFMoELayer computing the
    same function (weights copied). In place; returns the model. spare_slots: expert slots
    beyond the experts per layer (MoEConfig.spare_slots: replicas placed by
    moe.parallel.rebalance_experts), each starting as a copy of an expert. fp8: an
    moe.fp8.FP8Config for every converted layer (MoEConfig.fp8: FP8 experts / dispatch)."""
    config = model.config.get_text_config() if hasattr(model, "config") else None
    _check_supported(model)
    blocks = hf_blocks(model)
    inside = tuple(f"{path}." for path, _ in blocks)  # the table's blocks convert whole
    contract = [
        (n, m) for n, m in model.named_modules() if hf_contract.on_contract(m)
        if not n.startswith(inside)
    ]  # fmt: skip
    if not blocks and not contract:
        raise ValueError(
            f"from_hf: no sparse-MoE block in {type(model).__name__}: neither transformers' "
            f"experts contract (@use_experts_implementation) nor {sorted(FAMILIES)}"
        )
    for _, experts in contract:  # every refusal before anything changes
        hf_contract.experts_options(experts)
    for path, block in blocks:
        family = FAMILIES[type(block).__name__]
        ref = block.experts.down_proj
        layer = HFMoELayer(
            type(block),
            config,
            jitter=float(getattr(config, "router_jitter_noise", 0.0) or 0.0),
            name=path,
            device=ref.device,
            dtype=ref.dtype,
            spare_slots=spare_slots,
            fp8=fp8,
            **family.options(config),
        )
        # the router keeps float32 (float64 in a float64 model: its weights exactly)
        layer.router.to(torch.promote_types(block.gate.weight.dtype, torch.float32))
        _copy_in(layer, block)
        layer.train(block.training)
        parent, attr = _parent(model, path)
        setattr(parent, attr, layer)
    for path, experts in contract:  # the family's block and router kept, experts moe's
        hf_contract.convert(model, path, experts, spare_slots, fp8)
    if blocks and model not in _ROUTER_LOGITS_GUARDS:
        _ROUTER_LOGITS_GUARDS[model] = model.register_forward_pre_hook(
            _refuse_router_logits, with_kwargs=True
        )
    return model


# model -> the hook refusing output_router_logits while its blocks are moe layers
_ROUTER_LOGITS_GUARDS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def _refuse_router_logits(model: nn.Module, args, kwargs):
    """transformers collects router logits from the gate modules from_hf replaced (and would
    fail with an IndexError): one clear error instead, naming what to use."""
    asked = kwargs.get("output_router_logits")
    if asked is None:
        asked = getattr(getattr(model, "config", None), "output_router_logits", False)
    if asked:
        raise ValueError(
            f"{type(model).__name__} was converted by moe.from_hf: its router loss is computed "
            "by the MoE layers (moe.aux_loss(model), weighted like transformers' "
            "router_aux_loss_coef); call it with output_router_logits=False"
        )


def to_hf(model: nn.Module) -> nn.Module:
    """Put the original transformers blocks back, with the layers' (trained) weights. In place;
    returns the model. The experts must be whole (not sharded by expert parallelism)."""
    for path, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoELayer)]:
        _check_whole(path, layer)
        ref = layer.experts.w2
        block = layer.hf_block_class(layer.hf_config).to(device=ref.device, dtype=ref.dtype)
        _copy_out(block, layer)
        block.train(layer.training)
        parent, attr = _parent(model, path)
        setattr(parent, attr, block)
    for path, layer in [
        (n, m) for n, m in model.named_modules() if isinstance(m, hf_contract.HFExpertsLayer)
    ]:
        _check_whole(path, layer)
        hf_contract.restore(model, path, layer)
    guard = _ROUTER_LOGITS_GUARDS.pop(model, None)
    if guard is not None:  # the gates are back: transformers' router logits work again
        guard.remove()
    return model


def _check_whole(path: str, layer: MoELayer) -> None:
    if layer.experts.num_experts != layer.num_slots:
        raise ValueError(
            f"to_hf: {path} holds {layer.experts.num_experts} of {layer.config.num_experts} "
            "experts (expert parallel); use moe.save_hf_checkpoint, or load the full model "
            "in one process first"
        )
