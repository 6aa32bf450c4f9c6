"""The generic conversion: any transformers experts module on the experts contract
(@use_experts_implementation) -> an HFExpertsLayer, the family's own block and router kept.

The block still routes with its own router module (its exact scoring: softmax or sigmoid,
group-limited top-k, correction bias, renormalisation, scaling, hash routing) and calls
`self.experts(hidden_states, top_k_index, top_k_weights)`; that call now runs moe's dispatch
(the expert-parallel exchange once moe.parallel.parallelize installs it) and moe's experts.
Shared experts, their gates, dense layers and pre/post projections stay the family's modules.

What the experts compute is read from the module's declared flags (moe.interop.hf_experts):
    gated, gate rows first, the default `_apply_gate`, SiLU, no bias, no post norm -> swiglu
    not gated (`up_proj`), an activation moe has (silu, gelu, gelu_tanh, relu), biases or not
                                                   -> that activation, b1 / b2 from the biases
    anything else: an overridden `_apply_gate` (GPT-OSS's clamped SwiGLU, soft caps, ...),
    gate / up interleaved, biases on gated experts, an activation moe lacks (squared ReLU), a
    post-expert norm -> MoEConfig.quirks (moe.quirks): the family's own function and norm run
    between moe's grouped GEMMs; w1 / w3 hold the gate / up columns (in the module's order
    when interleaved), b1 / b3 / b2 the biases; the module's scalars, activation modules and
    post_expert_norm are the layer's (family_module), under the module's own names.
Refused with one ValueError naming the experts class and what: tensors beyond the contract's,
and a module whose own forward wraps the contract's (it computes more than the flags say).
Router replay and routing traces need moe's own router: not available on these layers.
"""

import copy

import torch
from torch import nn

from moe.gating.base import Routing
from moe.interop.hf_experts import (  # gate_up_columns: peft_contract reads it from here
    activation_name,
    gate_up_columns,  # noqa: F401
    gemm_weights,
    is_plain_swiglu,
    layout_flags,
    module_quirks,
    module_weights,
)
from moe.layer import MoELayer

# the config's experts per token, under the names the families use (Gemma 4: top_k_experts)
TOP_K_NAMES = (
    "num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_selected_experts", "top_k_experts"
)  # fmt: skip
CONTRACT = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias")
CONTRACT += ("down_proj_bias",)  # the contract's tensors (the rest: family_module)


def on_contract(module: nn.Module) -> bool:
    """Whether `module` is an experts module of transformers' experts contract."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "down_proj")


def experts_options(experts: nn.Module) -> dict:
    """MoELayer options computing what `experts` computes (`quirks`: MoEConfig.quirks for a
    layout beyond moe's plain expert MLP, else None), or a ValueError naming the experts class
    and what cannot be honoured."""
    name, cls = type(experts).__name__, type(experts)
    flags = layout_flags(experts)
    norm = flags["has_post_expert_norm"]
    extra = [n for n, _ in [*experts.named_parameters(), *experts.named_buffers()]]
    extra = [
        n for n in extra if n not in CONTRACT and not (norm and n.startswith("post_expert_norm."))
    ]
    if extra:
        reason = f"it holds tensors the contract's flags do not declare: {extra}"
    elif getattr(cls.forward, "__wrapped__", None) is None:  # the decorator's forward wraps
        reason = f"its own forward ({cls.__qualname__}.forward) around the contract's"
    else:
        reason = None
    if reason is not None:
        raise ValueError(
            f"from_hf: {name} cannot be converted: {reason}; run it on moe's kernels with "
            "experts_implementation='moe' (moe.interop.register_experts_implementation)"
        )
    act = activation_name(experts.act_fn) if hasattr(experts, "act_fn") else None
    gated = flags["has_gate"]
    plain = is_plain_swiglu(experts) or not gated and act is not None and not norm
    up_EDN, down_EFD = gemm_weights(experts)
    config = experts.config
    top_k = next((getattr(config, n) for n in TOP_K_NAMES if getattr(config, n, None)), None)
    if top_k is None:  # a guess would fail at the first forward, or route wrongly
        raise ValueError(
            f"from_hf: {name} cannot be converted: its config ({type(config).__name__}) names "
            f"its experts per token under none of {TOP_K_NAMES}"
        )
    return dict(
        d_model=up_EDN.shape[1],
        d_ff=down_EFD.shape[1],
        num_experts=experts.num_experts,
        top_k=min(int(top_k), experts.num_experts),
        capacity_factor=None,
        activation="swiglu" if gated else act or "relu",  # (quirks: the family's function)
        bias=bool(flags["has_bias"]),
        aux_loss_coef=0.0,  # the family's router keeps its own loss (output_router_logits)
        quirks=None if plain else module_quirks(experts),
    )


def family_module(experts: nn.Module) -> nn.Module:
    """The experts module without the contract's tensors: what its own function reads (its
    scalars, its parameter-free activation modules, its post_expert_norm), the submodules
    copied. Its `_apply_gate` / `act_fn` then runs on moe's GEMM outputs (moe.quirks)."""
    family = copy.copy(experts)
    family._parameters, family._buffers = {}, {}  # experts_options: all the contract's
    family._modules = copy.deepcopy(experts._modules)
    return family


class GivenRouting(nn.Module):
    """The router seat of an HFExpertsLayer: the family's router already chose (the block's
    top_k_index / top_k_weights, handed over by HFExpertsLayer.forward)."""

    replayable = False
    load_group = None

    def __init__(self):
        super().__init__()
        self.given: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x_TD: torch.Tensor) -> Routing:
        ids_TK, weights_TK = self.given
        E = self.num_experts
        probs_TE = x_TD.new_zeros(len(ids_TK), E, dtype=torch.float32)
        probs_TE = probs_TE.scatter_add(1, ids_TK, weights_TK.detach().float())
        return Routing(
            logits_TE=probs_TE,
            probs_TE=probs_TE,
            aux_loss=probs_TE.new_zeros(()),
            expert_ids_TK=ids_TK,
            weights_TK=weights_TK,
        )


class HFExpertsLayer(MoELayer):
    """An MoELayer in the seat of a transformers experts module: forward(hidden_states,
    top_k_index, top_k_weights) as the contract says. `hf_template` (the original module on
    the meta device, not a submodule) lets `to_hf` put the family's module back."""

    def __init__(self, template: nn.Module, family: nn.Module | None = None, **options):
        super().__init__(**options)
        self.router = GivenRouting()
        self.router.num_experts = self.config.num_experts
        self.hf_template = (template,)  # a tuple: not registered (no meta parameters here)
        if family is not None:  # MoEConfig.quirks: the family module's function computes
            for n, m in family.named_children():  # its norm and activations: this layer's,
                if hasattr(self, n):  # under the module's own names (dense parameters)
                    raise ValueError(f"from_hf: {type(template).__name__}.{n} is a name of moe's")
                self.add_module(n, m)
            self.experts.family = (family,)  # for the weight format (not registered twice)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.config.recompute:  # it would route again in backward, without the block's choice
            raise ValueError(
                f"{self.name}: MoEConfig.recompute on a layer the family's router feeds; "
                "recompute the family's decoder layers instead (moe.memory.recompute_blocks)"
            )
        if top_k_index.shape[-1] != self.config.top_k or top_k_index.dim() != 2:
            raise ValueError(
                f"{self.name}: expected top_k_index [T, {self.config.top_k}], got "
                f"{tuple(top_k_index.shape)}"
            )
        self.router.given = (top_k_index.long(), top_k_weights)
        try:
            return super().forward(hidden_states)
        finally:
            self.router.given = None


@torch.no_grad()
def _copy_in(layer: HFExpertsLayer, experts: nn.Module) -> None:
    slot_S = layer.expert_of_slot()
    for name, t in _named(module_weights(experts)):
        getattr(layer.experts, name).copy_(t[slot_S])


def _named(weights) -> list[tuple[str, torch.Tensor]]:
    """(moe's parameter name, tensor) of module_weights' present tensors."""
    w = weights
    pairs = [("w1", w.w1_LDF), ("w2", w.w2_LFD), ("w3", w.w3_LDF), ("b1", w.b1_LF)]
    pairs += [("b2", w.b2_LD), ("b3", w.b3_LF)]
    return [(n, t) for n, t in pairs if t is not None]


@torch.no_grad()
def write_back(experts: nn.Module, tensors: dict) -> None:
    """Write moe's tensors (w1, w2, w3, b1, b2, b3 in canonical expert order; absent ones
    skipped) into the experts module's own parameters, in its own layout."""
    for name, view in _named(module_weights(experts)):
        if tensors.get(name) is not None:
            view.copy_(tensors[name])


def convert(model: nn.Module, path: str, experts: nn.Module, spare_slots: int = 0, fp8=None):
    """Replace the experts module at `path` with an HFExpertsLayer (weights copied); fp8: the
    layer's MoEConfig.fp8."""
    options = experts_options(experts)
    ref = experts.down_proj
    layer = HFExpertsLayer(
        experts,
        family_module(experts) if options["quirks"] is not None else None,
        name=path,
        device=ref.device,
        dtype=ref.dtype,
        spare_slots=spare_slots,
        fp8=fp8,
        **options,
    )
    _copy_in(layer, experts)
    layer.train(experts.training)
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, layer)
    experts.to("meta")
    return layer


def restore(model: nn.Module, path: str, layer: HFExpertsLayer) -> nn.Module:
    """Put the family's experts module back at `path`, holding the layer's weights."""
    ref = layer.experts.w2
    experts = layer.hf_template[0].to_empty(device=ref.device).to(ref.dtype)
    slot_E = layer.slot_of_expert_E  # canonical order (placements; replicas: first copy)
    w = layer.experts
    names = ("w1", "w2", "w3", "b1", "b2", "b3")
    write_back(
        experts, {n: None if getattr(w, n, None) is None else getattr(w, n)[slot_E] for n in names}
    )
    family = getattr(w, "family", None)
    for n, _ in family[0].named_children() if family is not None else ():
        setattr(experts, n, getattr(layer, n))  # the norm and activations it computed with
    experts.train(layer.training)
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, experts)
    return experts
