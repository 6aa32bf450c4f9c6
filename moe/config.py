"""MoEConfig: every option of an MoE layer, validated at construction."""

from dataclasses import dataclass, fields, replace

from moe.kernels.activations import ACTIVATIONS
from moe.kernels.expert_mlp import BACKENDS

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("position", "probs")


@dataclass(frozen=True)
class MoEConfig:
    """Options of one MoE layer. Bad values raise ValueError naming the field.

    Capacity per expert is ceil(capacity_factor * top_k * T / E), at least `min_capacity`
    (and at most T); `capacity_factor=None` is dropless. Expert choice uses
    C = ceil(capacity_factor * T / E) tokens per expert (capacity_factor defaults to top_k).
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    router: str = "topk"
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None  # None: same as capacity_factor
    min_capacity: int = 4
    drop_policy: str = "position"  # "position": token order, first choices first; "probs"
    score_func: str = "softmax"  # "softmax" or "sigmoid"
    softmax_before_topk: bool = True  # False: top-k on logits, then softmax over the k
    normalize_weights: bool = False  # renormalise the k combine weights to sum to 1
    route_scale: float = 1.0
    num_groups: int = 1  # group-limited routing: experts split into groups...
    topk_groups: int = 1  # ...and tokens pick experts only inside their best groups
    jitter_eps: float = 1e-2  # switch: multiplicative input jitter U(1-eps, 1+eps) in training
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing by a per-expert bias
    activation: str = "gelu"
    bias: bool = False
    backend: str = "auto"
    checkpoint: bool = False  # recompute the layer in backward (activation checkpointing)
    check_finite: bool = False  # debug: NaN/Inf in expert weights/outputs raises (host sync)

    def __post_init__(self):
        for name in ("d_model", "d_ff", "num_experts", "top_k", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None (dropless), got {value!r}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")
        _choose("drop_policy", self.drop_policy, DROP_POLICIES)
        _choose("score_func", self.score_func, SCORE_FUNCS)
        _choose("activation", self.activation, ACTIVATIONS)
        _choose("backend", self.backend, BACKENDS)
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"num_groups={self.num_groups} must divide num_experts={self.num_experts}"
            )
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_groups={self.topk_groups} exceeds num_groups={self.num_groups}")
        if self.num_groups > 1 and self.top_k > self.topk_groups * (
            self.num_experts // self.num_groups
        ):
            raise ValueError("top_k exceeds the experts available in topk_groups groups")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "jitter_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.route_scale <= 0:
            raise ValueError(f"route_scale must be > 0, got {self.route_scale}")
        from moe.gating import ROUTERS

        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r} is unknown; registered: {sorted(ROUTERS)}")
        ROUTERS[self.router].check_config(self)

    def replace(self, **changes) -> "MoEConfig":
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def _choose(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")
