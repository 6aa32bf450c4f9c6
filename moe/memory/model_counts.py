"""The model a memory estimate reads (`PlannerModel`: a config object with its sizes and
`build()`) and its parameter counts, from building it on the meta device (no memory allocated).
The layout planner (moe.plan) reads models through the same interface."""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from moe.experts import expert_parameters
from moe.layer import MoELayer


@runtime_checkable
class PlannerModel(Protocol):
    """The model interface of `estimate_memory`, `count_parameters`, `activation_bytes` and
    moe.plan: a config object of a decoder-style transformer (examples/m6's M6Config).

    Required: the attributes below and `build()`, which returns the nn.Module (called under
    torch.device("meta")). Optional attributes, read with these defaults (PLANNER_DEFAULTS):
    `moe_every` (1: block i is MoE when (i + 1) % moe_every == 0), `activation` ("gelu"; a
    gated one such as "swiglu" counts a third projection), `text_len` (seq_len: the positions
    the output head scores, for models whose sequence also holds non-text positions).
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int  # FFN width of a dense block and of each expert
    vocab_size: int
    seq_len: int  # positions per sequence
    num_experts: int  # 0: dense
    top_k: int
    capacity_factor: float | None  # None: dropless

    def build(self) -> nn.Module: ...


PLANNER_DEFAULTS = {"moe_every": 1, "activation": "gelu", "text_len": None}


def optional(cfg: PlannerModel, name: str):
    """An optional PlannerModel attribute, or its default (text_len: seq_len)."""
    value = getattr(cfg, name, PLANNER_DEFAULTS[name])
    return cfg.seq_len if value is None and name == "text_len" else value


@dataclass(frozen=True)
class ParamCounts:
    total: int
    dense: int
    expert: int
    moe_layers: int = 0
    trainable: int | None = None  # requires_grad parameters (None: all)
    trainable_expert: int | None = None


def count_parameters(model_config: PlannerModel) -> ParamCounts:
    """Parameter counts of `model_config.build()` built on the meta device."""
    with torch.device("meta"):
        model = model_config.build()
    expert_ids, expert = set(), 0
    for _, p in expert_parameters(model):
        if id(p) not in expert_ids:
            expert_ids.add(id(p))
            expert += p.numel()
    total = sum(p.numel() for p in model.parameters())
    layers = sum(isinstance(m, MoELayer) for m in model.modules())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t_expert = sum(p.numel() for i in expert_ids for p in [_by_id(model, i)] if p.requires_grad)
    return ParamCounts(total, total - expert, expert, layers, trainable, t_expert)


def _by_id(model: nn.Module, ident: int) -> torch.Tensor:
    return next(p for p in model.parameters() if id(p) == ident)
