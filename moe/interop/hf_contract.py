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
Anything else (an overridden `_apply_gate` such as GPT-OSS's clamped SwiGLU, a bias on gated
experts, a post-expert norm, another activation) is refused with one ValueError naming the
experts class and the flag; those families run on moe's kernels through
experts_implementation="moe" instead. Router replay and routing traces need moe's own router:
not available on these layers.
"""

import torch
from torch import nn

from moe.gating.base import Routing
from moe.interop.hf_experts import activation_name, gemm_weights, layout_flags
from moe.layer import MoELayer

TOP_K_NAMES = ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_selected_experts")


def on_contract(module: nn.Module) -> bool:
    """Whether `module` is an experts module of transformers' experts contract."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "down_proj")


def experts_options(experts: nn.Module) -> dict:
    """MoELayer options computing what `experts` computes, or a ValueError naming the experts
    class and the flag moe's experts cannot honour."""
    name = type(experts).__name__
    flags = layout_flags(experts)
    known = {"gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias"}
    known |= {"down_proj_bias"}
    extra = [n for n, _ in [*experts.named_parameters(), *experts.named_buffers()]]
    extra = [n for n in extra if n not in known and not n.startswith("post_expert_norm.")]
    act = activation_name(experts.act_fn) if hasattr(experts, "act_fn") else None
    if extra:
        reason = f"it holds tensors moe's experts do not have: {extra}"
    elif flags["has_post_expert_norm"]:
        reason = "has_post_expert_norm=True (a norm on each expert's output)"
    elif flags["has_gate"] and not flags["default_gate"]:
        reason = f"its own _apply_gate ({type(experts).__qualname__}._apply_gate)"
    elif flags["has_gate"] and not flags["is_concatenated"]:
        reason = "is_concatenated=False (interleaved gate/up) with the default _apply_gate"
    elif flags["has_gate"] and flags["has_bias"]:
        reason = "has_bias=True on gated experts (moe's gated experts have no up-projection bias)"
    elif flags["has_gate"] and act != "silu" or act is None:
        reason = f"activation {type(experts.act_fn).__name__} (moe has silu, gelu, gelu_tanh, relu)"
    else:
        reason = None
    if reason is not None:
        raise ValueError(
            f"from_hf: {name} cannot be converted: {reason}; run it on moe's kernels with "
            "experts_implementation='moe' (moe.interop.register_experts_implementation)"
        )
    up_EDN, down_EFD = gemm_weights(experts)
    config = experts.config
    top_k = next((getattr(config, n) for n in TOP_K_NAMES if getattr(config, n, None)), 1)
    return dict(
        d_model=up_EDN.shape[1],
        d_ff=down_EFD.shape[1],
        num_experts=experts.num_experts,
        top_k=min(int(top_k), experts.num_experts),
        capacity_factor=None,
        activation="swiglu" if flags["has_gate"] else act,
        bias=bool(flags["has_bias"]),
        aux_loss_coef=0.0,  # the family's router keeps its own loss (output_router_logits)
    )


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

    def __init__(self, template: nn.Module, **options):
        super().__init__(**options)
        self.router = GivenRouting()
        self.router.num_experts = self.config.num_experts
        self.hf_template = (template,)  # a tuple: not registered (no meta parameters here)

    def forward(self, hidden_states, top_k_index, top_k_weights):
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
    up_EDN, down_EFD = gemm_weights(experts)
    F = layer.config.d_ff
    slot_S = layer.expert_of_slot()
    w = layer.experts
    w.w1.copy_(up_EDN[..., :F][slot_S])
    w.w2.copy_(down_EFD[slot_S])
    if w.w3 is not None:
        w.w3.copy_(up_EDN[..., F:][slot_S])
    if w.b1 is not None:
        w.b1.copy_(experts.up_proj_bias[slot_S])
        w.b2.copy_(experts.down_proj_bias[slot_S])


@torch.no_grad()
def write_back(experts: nn.Module, tensors: dict) -> None:
    """Write moe's tensors (w1, w2, w3, b1, b2 in canonical expert order; absent ones
    skipped) into the experts module's own parameters, in its own layout."""
    up_EDN, down_EFD = gemm_weights(experts)
    F = down_EFD.shape[1]
    up_EDN[..., :F].copy_(tensors["w1"])
    down_EFD.copy_(tensors["w2"])
    if tensors.get("w3") is not None:
        up_EDN[..., F:].copy_(tensors["w3"])
    if tensors.get("b1") is not None:
        experts.up_proj_bias.copy_(tensors["b1"])
        experts.down_proj_bias.copy_(tensors["b2"])


def convert(model: nn.Module, path: str, experts: nn.Module, spare_slots: int = 0):
    """Replace the experts module at `path` with an HFExpertsLayer (weights copied)."""
    options = experts_options(experts)
    ref = experts.down_proj
    layer = HFExpertsLayer(
        experts,
        name=path,
        device=ref.device,
        dtype=ref.dtype,
        spare_slots=spare_slots,
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
    names = ("w1", "w2", "w3", "b1", "b2")
    write_back(
        experts, {n: None if getattr(w, n) is None else getattr(w, n)[slot_E] for n in names}
    )
    experts.train(layer.training)
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, experts)
    return experts
