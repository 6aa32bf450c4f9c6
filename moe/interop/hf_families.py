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

    def hub_path(self, path: str) -> str:
        """The block's key prefix in hub checkpoints (model.layers.3.mlp ->
        model.layers.3.block_sparse_moe for Mixtral)."""
        if self.hub_block is None:
            return path
        parent, _, _ = path.rpartition(".")
        return f"{parent}.{self.hub_block}" if parent else self.hub_block

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
            aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
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
        Family("Qwen2MoeSparseMoeBlock", "num_experts", "moe_intermediate_size", shared="qwen2"),
        Family("Qwen3MoeSparseMoeBlock", "num_experts", "moe_intermediate_size"),
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
