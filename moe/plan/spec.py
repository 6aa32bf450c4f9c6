"""ModelSpec: what the planner needs to know of a decoder MoE model, read from a Hugging Face
config.json (the families moe.interop reads, DeepSeek-V3 / Kimi K2 included), a named preset of
a published model, or a moe.memory.PlannerModel (the M6 example's config).

Parameter counts are arithmetic on the config (no model is built, so a 1T model plans in
microseconds); per layer, with d = d_model and a gated FFN (SwiGLU: 3 matrices, else 2):
  attention  GQA: d * (heads + 2 kv_heads) * head_dim + heads * head_dim * d
             MLA (DeepSeek): q (through q_lora_rank when given), kv down to kv_lora_rank +
             rope dims, kv up to heads * (nope + v), out heads * v_head * d
  dense FFN  mats * d * d_ff_dense          one expert  mats * d * d_ff_expert
  router     d * E                          shared      mats * d * d_ff_shared
  norms      2 d per layer (+ query / key norms: Qwen3 per head, OLMoE whole), d at the end; embedding V d, head V d unless tied.
Forward FLOPs per token: 2 per weight a token meets (top_k experts of E) plus attention's
scores and values, 2 * 2 * heads * (qk_dim + v_dim) / 2 * seq_len (causal: half the context
on average).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe.names import GATED_ACTIVATIONS
from moe.plan.built import BuiltCounts


@dataclass(frozen=True)
class ModelSpec:
    """A decoder MoE model's sizes. MoE blocks: every block from `first_dense` on, every
    `moe_every`-th ((i + 1) % moe_every == 0); the rest dense."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    num_experts: int
    top_k: int
    d_ff_expert: int
    d_ff_dense: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    first_dense: int = 0
    moe_every: int = 1
    shared_d_ff: int = 0  # total width of the shared experts (0: none)
    gated: bool = True
    tie_embeddings: bool = False
    # multi-head latent attention (DeepSeek-V2/V3, Kimi K2); None: grouped-query attention
    mla: tuple[int, int, int, int, int] | None = None  # q_lora, kv_lora, nope, rope, v_head
    qk_norm: int = 0  # per-layer weights of query / key norms (Qwen3: per head; OLMoE: whole)
    # the counts of the model itself (moe.plan.built: a meta-device build of its config); when
    # set, every parameter count below is read from it, not from the arithmetic
    built: BuiltCounts | None = None

    def __post_init__(self) -> None:
        for f in ("n_layers", "d_model", "n_heads", "vocab_size", "top_k", "d_ff_expert"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelSpec.{f} must be an int >= 1, got {v!r}")
        if self.num_experts < 1 or self.top_k > self.num_experts:
            raise ValueError(
                f"ModelSpec: top_k={self.top_k} of num_experts={self.num_experts} (need 1 <= "
                "top_k <= num_experts)"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hdim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def is_moe(self, i: int) -> bool:
        if self.built is not None:
            return self.built.layers[i][1] > 0
        return i >= self.first_dense and (i + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    @property
    def mats(self) -> int:
        return 3 if self.gated else 2

    def attention_params(self) -> int:
        d, h = self.d_model, self.n_heads
        if self.mla is None:
            return d * (h + 2 * self.kv_heads) * self.hdim + h * self.hdim * d
        q_lora, kv_lora, nope, rope, v = self.mla
        q = (d * q_lora + q_lora + q_lora * h * (nope + rope)) if q_lora else d * h * (nope + rope)
        kv = d * (kv_lora + rope) + kv_lora + kv_lora * h * (nope + v)
        return q + kv + h * v * d

    def expert_params(self) -> int:
        """One routed expert's weights."""
        return self.mats * self.d_model * self.d_ff_expert

    def layer_params(self, i: int) -> tuple[int, int]:
        """(dense, routed-expert) parameters of block i (router and shared experts are dense)."""
        if self.built is not None:
            return self.built.layers[i]
        dense = self.attention_params() + 2 * self.d_model + self.qk_norm
        if not self.is_moe(i):
            return dense + self.mats * self.d_model * self.d_ff_dense, 0
        shared = self.mats * self.d_model * self.shared_d_ff
        experts = self.num_experts * self.expert_params()
        return dense + self.d_model * self.num_experts + shared, experts

    def active_expert_params(self, i: int) -> int:
        """The routed-expert parameters one token meets in block i (top_k of its experts)."""
        experts = self.layer_params(i)[1]
        return experts * self.top_k // self.num_experts

    def embedding_params(self) -> int:
        """Embeddings (with a built model: every parameter outside the blocks and the head,
        a multimodal model's vision tower included)."""
        if self.built is not None:
            return self.built.embedding
        return self.vocab_size * self.d_model

    def head_params(self) -> int:
        if self.built is not None:
            return self.built.head
        return self.d_model + (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    def total_params(self) -> int:
        layers = sum(sum(self.layer_params(i)) for i in range(self.n_layers))
        return self.embedding_params() + layers + self.head_params()

    def active_params(self) -> int:
        """Parameters one token meets: every dense weight, top_k experts per MoE block."""
        total = self.embedding_params() + self.head_params()
        for i in range(self.n_layers):
            dense, experts = self.layer_params(i)
            total += dense + self.active_expert_params(i)
        return total

    def layer_flops(self, i: int, seq_len: int) -> tuple[float, float]:
        """Forward FLOPs per token of block i: (dense part incl. attention, routed experts)."""
        dense, experts = self.layer_params(i)
        qk, v = (self.mla[2] + self.mla[3], self.mla[4]) if self.mla else (self.hdim, self.hdim)
        attn_core = 2 * self.n_heads * (qk + v) * seq_len / 2
        routed = 2 * self.active_expert_params(i)
        return 2 * dense + attn_core, routed

    def head_flops(self) -> float:
        return 2 * self.vocab_size * self.d_model

    def with_(self, **changes) -> ModelSpec:
        return replace(self, **changes)


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def from_hf_config(cfg: dict, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a transformers config.json's fields (Qwen3-MoE, Qwen2-MoE, Mixtral,
    OLMoE, DeepSeek-V3, Kimi K2). A config without routed experts is refused."""
    experts = _get(cfg, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if not experts:
        raise ValueError(
            f"config {name or cfg.get('model_type')!r} has no routed experts (num_experts, "
            "num_local_experts or n_routed_experts): the planner plans MoE models"
        )
    d_ff = cfg.get("intermediate_size")
    d_ff_expert = _get(cfg, "moe_intermediate_size", default=d_ff)
    if isinstance(d_ff_expert, list):  # experts of several widths (ERNIE-4.5-VL): the widest
        d_ff_expert = max(d_ff_expert)
    first_dense = _get(cfg, "first_k_dense_replace", default=0)
    moe_every = _get(cfg, "decoder_sparse_step", "moe_layer_freq", default=1)
    shared = _get(cfg, "n_shared_experts", default=0) * d_ff_expert
    shared = _get(cfg, "shared_expert_intermediate_size", default=shared)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = (
            cfg.get("q_lora_rank") or 0,
            cfg["kv_lora_rank"],
            cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"],
            cfg["v_head_dim"],
        )
    act = cfg.get("hidden_act", "silu")
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qk_norm = {"qwen3_moe": 2 * head_dim, "olmoe": (heads + kv) * head_dim}.get(
        cfg.get("model_type"), 0
    )
    return ModelSpec(
        name=name or cfg.get("model_type", "hf"),
        n_layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        n_heads=cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"],
        num_experts=experts,
        top_k=_get(cfg, "num_experts_per_tok", "top_k", "moe_topk", "moe_k", default=2),
        d_ff_expert=d_ff_expert,
        d_ff_dense=d_ff or d_ff_expert,
        n_kv_heads=cfg.get("num_key_value_heads"),
        head_dim=cfg.get("head_dim"),
        first_dense=first_dense,
        moe_every=moe_every,
        shared_d_ff=shared,
        gated=act in ("silu", "swiglu", "swish") or act in GATED_ACTIVATIONS,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mla=mla,
        qk_norm=qk_norm,
    )


def from_planner_model(cfg, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a moe.memory.PlannerModel (the M6 example's M6Config)."""
    activation = getattr(cfg, "activation", "gelu")
    return ModelSpec(
        name=name or getattr(cfg, "name", type(cfg).__name__),
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        vocab_size=cfg.vocab_size,
        num_experts=max(cfg.num_experts, 1),
        top_k=min(cfg.top_k, max(cfg.num_experts, 1)),
        d_ff_expert=cfg.d_ff,
        d_ff_dense=cfg.d_ff,
        moe_every=getattr(cfg, "moe_every", 1) if cfg.num_experts else cfg.n_layers + 1,
        gated=activation in GATED_ACTIVATIONS,
    )
