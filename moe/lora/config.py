"""LoRAConfig: the settings of low-rank adapters on a model's MoE layers (moe.lora.add_lora),
one typed, validated value; MoEConfig.lora records it on each adapted layer so checkpoints and
export read rank, alpha and targets from the layer."""

import math
from dataclasses import dataclass

EXPERT_TARGETS = ("w1", "w2", "w3")  # gate, down, up (hub gate_proj / down_proj / up_proj)


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """rank: r of every adapter (A [in, r], B [r, out] per expert and projection).
    alpha: the adapters' output is scaled by alpha / rank (PEFT's lora_alpha).
    dropout: PEFT's lora_dropout, on each adapter's input in training; in [0, 1).
    targets: the expert projections adapted, a non-empty subset of ("w1", "w2", "w3").
    router: also adapt the router's weight [E, D] (a plain per-matrix LoRA).
    shared_experts: also adapt the shared experts' linear layers (plain per-matrix LoRA)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = EXPERT_TARGETS
    router: bool = False
    shared_experts: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRAConfig.rank must be a positive int, got {self.rank!r}")
        for name in ("alpha", "dropout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"LoRAConfig.{name} must be a finite number, got {v!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str) or not isinstance(self.targets, (tuple, list)):
            raise ValueError(f"LoRAConfig.targets must be a tuple of names, got {self.targets!r}")
        targets = tuple(self.targets)
        bad = [t for t in targets if t not in EXPERT_TARGETS]
        if bad or len(set(targets)) != len(targets) or not targets:
            raise ValueError(
                f"LoRAConfig.targets must be distinct names among {EXPERT_TARGETS}, got {targets!r}"
            )
        object.__setattr__(self, "targets", targets)  # (a list from JSON)
        for name in ("router", "shared_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoRAConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def scale(self) -> float:
        """alpha / rank: what the adapters' output is multiplied by."""
        return self.alpha / self.rank
