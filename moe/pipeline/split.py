"""Splitting a sequential stack into pipeline stages at block boundaries.

A model is split from outside, before parallelize (as torchtitan does): the model is an
nn.Sequential whose children run in order (an embedding, blocks, a head, ...); stage s keeps
its children under their names in the whole model, so parameter names (and checkpoints) are
the single-process ones on every stage.
"""

from collections import OrderedDict

import torch
from torch import nn

from moe.layer import moe_layers
from moe.pipeline.aux import attach_aux


def plan_stages(model: nn.Module, num_stages: int, stages=None) -> list[list[str]]:
    """The child names of each stage: `stages` checked (every child once, in order), or an
    even split by child count (the first len % num_stages stages take one more)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"the pipeline splits an nn.Sequential stack (children run in order), got "
            f"{type(model).__name__}"
        )
    names = [name for name, _ in model.named_children()]
    if stages is None:
        if len(names) < num_stages:
            raise ValueError(f"the model has {len(names)} children, fewer than {num_stages} stages")
        base, extra = divmod(len(names), num_stages)
        sizes = [base + (s < extra) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(num_stages)]
        return [names[a : a + n] for a, n in zip(starts, sizes)]
    if len(stages) != num_stages:
        raise ValueError(f"stages has {len(stages)} entries for {num_stages} stages")
    flat = [n for stage in stages for n in stage]
    unknown = [n for n in flat if n not in names]
    if unknown:
        raise ValueError(f"stages names {unknown}, not children of the model (it has {names})")
    repeated = sorted({n for n in flat if flat.count(n) > 1})
    if repeated:
        raise ValueError(f"stages names {repeated} more than once")
    if flat != names:
        missing = [n for n in names if n not in flat]
        why = f"misses {missing}" if missing else "is out of order"
        raise ValueError(f"stages {why}: every child of the model once, in order ({names})")
    return [list(stage) for stage in stages]


class PipelineStageModule(nn.Sequential):
    """One stage: its children in order, under their names in the whole model. Its output
    carries the stage's MoE aux loss into the backward (moe.pipeline.aux); each training
    forward's aux loss is kept (detached) in `aux_values` for logging."""

    def __init__(self, children: "OrderedDict[str, nn.Module]", aux_scale: float):
        super().__init__(children)
        self.aux_scale = aux_scale
        self.aux_values: list[torch.Tensor] = []

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the stage's MoE layers' aux_loss from the last forward (None: no MoE layer)."""
        losses = [layer.aux_loss for _, layer in moe_layers(self)]
        return torch.stack(losses).sum() if losses else None

    def forward(self, x):
        y = super().forward(x)
        aux = self.aux_loss()
        if aux is None:
            return y
        if self.training:
            self.aux_values.append(aux.detach())
        return attach_aux(y, aux, self.aux_scale)


def build_stage(model: nn.Sequential, names: list[str], aux_scale: float) -> PipelineStageModule:
    """The stage holding `names` (children of `model`, moved, not copied)."""
    children = dict(model.named_children())
    return PipelineStageModule(OrderedDict((n, children[n]) for n in names), aux_scale)
