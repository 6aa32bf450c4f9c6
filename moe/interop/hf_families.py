"""What each Hugging Face sparse-MoE block computes, as MoEConfig options (transformers 5).

Read from transformers' modeling files (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3):
every family routes in float32, takes the top-k of the scores and runs SiLU-gated experts
stored fused as `experts.gate_up_proj` [E, 2F, d] (gate rows first) and `experts.down_proj`
[E, d, F]; the router is `gate.weight` [E, d].
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One block class: how to read its config into MoEConfig options."""

    block: str  # class name of the sparse-MoE block
    num_experts: str  # config attribute
    d_ff: str
    shared: str | None = None  # None | "qwen2" (shared_expert + sigmoid gate) | "deepseek"
    sigmoid_groups: bool = False  # DeepSeek-V3: sigmoid, bias for choice, group-limited top-k
    norm_topk: str | None = "norm_topk_prob"  # config attribute; None: always renormalised
    hub_block: str | None = None  # the block's name on the hub when it differs (Mixtral)
    hub_experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # w1, w3, w2
    # Which decoder layers hold the block: "all", or "qwen" (not in mlp_only_layers, and
    # (i + 1) % decoder_sparse_step == 0, as Qwen2-MoE / Qwen3-MoE decide)
    sparse_layers: str = "all"

    def hub_path(self, path: str) -> str:
        """The block's key prefix in hub checkpoints (model.layers.3.mlp ->
        model.layers.3.block_sparse_moe for Mixtral)."""
        if self.hub_block is None:
            return path
        parent, _, _ = path.rpartition(".")
        return f"{parent}.{self.hub_block}" if parent else self.hub_block

    def num_sparse_layers(self, config) -> int:
        """How many of the model's decoder layers hold this block."""
        L = config.num_hidden_layers
        if self.sparse_layers == "all":
            return L
        only = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        experts = getattr(config, self.num_experts)
        return sum(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(L))

    def aux_loss_coef(self, config) -> float:
        """The layers' aux_loss_coef for transformers' `router_aux_loss_coef`.

        transformers adds coef * E * sum_e f_e P_e to the loss (load_balancing_loss_func, with
        output_router_logits=True), f_e the tokens routed to e over all tokens (summing to k
        over e: k times moe's f_e, pairs over T*k), f and P pooled over the model's L sparse
        layers; moe.aux_loss sums the L layers' own terms. coef * k / L per layer is then
        transformers' loss exactly for one sparse layer, and for L the mean of the layers'
        terms (the pooled term differs from that mean only by how the layers' loads differ).
        """
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        layers = self.num_sparse_layers(config)
        return coef * config.num_experts_per_tok / layers if coef and layers else 0.0

    @property
    def shared_name(self) -> str:
        return "shared_expert" if self.shared == "qwen2" else "shared_experts"

    def options(self, config) -> dict:
        """MoELayer keyword arguments computing what the block computes."""
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"{self.block}: hidden_act={config.hidden_act!r} is not supported (only silu)"
            )
        options = dict(
            d_model=config.hidden_size,
            d_ff=getattr(config, self.d_ff),
            num_experts=getattr(config, self.num_experts),
            top_k=config.num_experts_per_tok,
            capacity_factor=None,
            activation="swiglu",
            normalize_weights=True
            if self.norm_topk is None
            else bool(getattr(config, self.norm_topk)),
            aux_loss_coef=self.aux_loss_coef(config),
        )
        if self.sigmoid_groups:
            options.update(
                score_func="sigmoid",
                num_groups=config.n_group,
                topk_groups=config.topk_group,
                route_scale=float(config.routed_scaling_factor),
                aux_loss_coef=0.0,
            )
        if self.shared == "qwen2":
            options.update(
                num_shared_experts=1,
                shared_d_ff=config.shared_expert_intermediate_size,
                shared_expert_gate=True,
            )
        elif self.shared == "deepseek":
            options.update(
                num_shared_experts=config.n_shared_experts,
                shared_d_ff=config.moe_intermediate_size * config.n_shared_experts,
            )
        return options


FAMILIES = {
    f.block: f
    for f in (
        Family(
            "MixtralSparseMoeBlock",
            "num_local_experts",
            "intermediate_size",
            norm_topk=None,
            hub_block="block_sparse_moe",
            hub_experts=("w1", "w3", "w2"),
        ),
        Family(
            "Qwen2MoeSparseMoeBlock",
            "num_experts",
            "moe_intermediate_size",
            shared="qwen2",
            sparse_layers="qwen",
        ),
        Family(
            "Qwen3MoeSparseMoeBlock", "num_experts", "moe_intermediate_size", sparse_layers="qwen"
        ),
        Family("OlmoeSparseMoeBlock", "num_experts", "intermediate_size"),
        Family(
            "DeepseekV3MoE",
            "n_routed_experts",
            "moe_intermediate_size",
            shared="deepseek",
            sigmoid_groups=True,
        ),
    )
}
