"""LoRA's weight format: the experts' dense weights, frozen, plus per-expert low-rank adapters
lora_A_<w> [E, in, r] and lora_B_<w> [E, r, out] for each target w of w1, w2, w3 (dim 0 the
expert: expert parallelism and FSDP shard them as they shard the weights). The kernel gets
LoRAWeights (the experts' weights + the adapters) and LoRAKernel adds scale * dropout(x) A B to
each projection (moe/lora/kernel.py). Claimed by MoEConfig(lora=LoRAConfig(...)), the one
setting; moe.lora.add_lora puts it on a built model."""

import math
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.weight_format import WeightFormat, register_weight_format
from moe.lora.config import LoRAConfig
from moe.shards import local

PREFIXES = ("lora_A_", "lora_B_")


@dataclass(frozen=True, eq=False)
class LoRAWeights(ExpertWeights):
    """The experts' weights plus their adapters by name: A_<w> [L, in, r], B_<w> [L, r, out]
    for w in w1, w2, w3; the MLP adds scale * dropout(x) @ A @ B (dropout p) to x @ W. Sliced,
    mapped and flattened with the weights (ExpertWeights' tensor slots include `adapters`)."""

    adapters: dict[str, torch.Tensor] = field(default_factory=dict)
    scale: float = 1.0
    dropout: float = 0.0

    @classmethod
    def of(cls, base: ExpertWeights, **lora) -> "LoRAWeights":
        return cls(**{f.name: getattr(base, f.name) for f in fields(base)}, **lora)


def projection_shape(experts: nn.Module, target: str) -> tuple[int, int] | None:
    """(in, out) of expert projection `target` ("w1", "w2", "w3"); None when it is absent."""
    if getattr(experts, target, None) is None:
        return None
    d, f = experts.d_model, experts.d_ff
    return (f, d) if target == "w2" else (d, f)


def check_rank(config: LoRAConfig, in_out: tuple[int, int], where: str) -> None:
    """rank <= min(in, out), one ValueError naming the matrix otherwise."""
    if config.rank > min(in_out):
        raise ValueError(
            f"LoRAConfig.rank={config.rank} exceeds min(in, out)={min(in_out)} of {where} "
            f"({in_out[0]} x {in_out[1]})"
        )


def init_lora_A(a: torch.Tensor) -> None:
    """PEFT's default init of A (kaiming-uniform with a = sqrt(5), as nn.Linear's weight):
    U(-1/sqrt(in), 1/sqrt(in)), `in` = dim -2 of a [..., in, r]."""
    if a.device.type != "meta":
        bound = 1.0 / math.sqrt(a.shape[-2])
        with torch.no_grad():
            a.uniform_(-bound, bound)


@dataclass(frozen=True)
class LoRAFormat(WeightFormat):
    """config: the layer's LoRAConfig (MoEConfig.lora; `claims` returns the instance)."""

    config: LoRAConfig | None = None
    selected_by = "MoEConfig.lora"

    def claims(self, config) -> "LoRAFormat | None":
        return None if config.lora is None else LoRAFormat(self.name, config.lora)

    def setup(self, experts: nn.Module) -> None:
        """Freeze the experts' weights and add the adapters (A random, B zero: output unchanged)."""
        c = self.config
        for p in experts.parameters(recurse=False):
            p.requires_grad_(False)
        for t in c.targets:
            shape = projection_shape(experts, t)
            if shape is None:
                continue
            check_rank(c, shape, f"experts.{t}")
            w = getattr(experts, t)
            kw = {"device": w.device, "dtype": w.dtype}
            E = w.shape[0]
            a = nn.Parameter(torch.empty(E, shape[0], c.rank, **kw))
            init_lora_A(a)
            setattr(experts, f"lora_A_{t}", a)
            setattr(experts, f"lora_B_{t}", nn.Parameter(torch.zeros(E, c.rank, shape[1], **kw)))

    def weights(self, experts: nn.Module) -> LoRAWeights:
        base = super().weights(experts)
        adapters = {}
        for t in self.config.targets:
            a = getattr(experts, f"lora_A_{t}", None)
            if a is not None:
                adapters[f"A_{t}"] = local(a)
                adapters[f"B_{t}"] = local(getattr(experts, f"lora_B_{t}"))
        dropout = self.config.dropout if experts.training else 0.0
        return LoRAWeights.of(base, adapters=adapters, scale=self.config.scale, dropout=dropout)


LORA = register_weight_format(LoRAFormat("lora"))
