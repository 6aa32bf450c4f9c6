"""The "lora" weight format: the experts' dense weights, frozen, plus per-expert low-rank
adapters lora_A_<w> [E, in, r] and lora_B_<w> [E, r, out] for each target w of w1, w2, w3
(dim 0 the expert: expert parallelism and FSDP shard them as they shard the weights). The
kernel gets them in ExpertWeights.adapters and adds scale * dropout(x) A B to each projection
(moe/kernels/adapted_mlp.py). MoEConfig(weight_format="lora", lora=LoRAConfig(...)) selects it;
moe.lora.add_lora puts it on a built model."""

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.weight_format import WeightFormat, register_weight_format
from moe.lora.config import LoRAConfig
from moe.shards import local

PREFIXES = ("lora_A_", "lora_B_")


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
    """config: the layer's LoRAConfig (MoEConfig.lora; `for_config` returns the instance)."""

    config: LoRAConfig | None = None

    def for_config(self, config) -> "LoRAFormat":
        return LoRAFormat(self.name, config.lora)

    def setup(self, experts: nn.Module) -> None:
        """Freeze the experts' weights and add the adapters (A random, B zero: output unchanged)."""
        c = self.config
        if c is None:
            raise ValueError("weight_format='lora' needs MoEConfig.lora (a LoRAConfig)")
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

    def weights(self, experts: nn.Module) -> ExpertWeights:
        base = super().weights(experts)
        adapters = {}
        for t in self.config.targets:
            a = getattr(experts, f"lora_A_{t}", None)
            if a is not None:
                adapters[f"A_{t}"] = local(a)
                adapters[f"B_{t}"] = local(getattr(experts, f"lora_B_{t}"))
        dropout = self.config.dropout if experts.training else 0.0
        return replace(
            base, adapters=adapters, adapter_scale=self.config.scale, adapter_dropout=dropout
        )


LORA = register_weight_format(LoRAFormat("lora"))
