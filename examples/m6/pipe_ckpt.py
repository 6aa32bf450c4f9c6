"""Checkpoints under --pp: this rank's stage tensors under the single-process M6Model's names,
as one moe.checkpoint.parts.ModelParts, so moe.checkpoint saves and loads them like the
single-process model's (one format: a checkpoint of --pp 2 --ep 2 resumes at --pp 1, on one
process, and the other way round).

The pipeline's children are named for the schedule (`embed`, `blocks_1`, `head`); here their
modules are grafted at the single-process paths (`tok_embed`, `blocks.1.ffn`, `ln_f`) and the
position embedding, a parameter of the whole model, is registered at `pos_embed`. The head's
copy of tok_embed.weight is not in the checkpoint (nor in the optimizer): after a load
PipelineRun.sync_tied refreshes it from tok_embed.weight.
"""

from __future__ import annotations

from torch import nn

from examples.m6.pipe_model import M6Embed, M6Head, M6PipeBlock
from moe.checkpoint.parts import ModelParts
from moe.layer import moe_layers
from moe.pipeline.split import graft

BLOCK = "blocks_"


def single_paths(name: str, child: nn.Module) -> dict[str, nn.Module]:
    """{single-process path: module} of one pipeline child (its modules, not copies)."""
    if isinstance(child, M6Embed):
        return {k: getattr(child, k) for k in ("patch_embed", "tok_embed", "type_embed")}
    if isinstance(child, M6PipeBlock):
        i = name.removeprefix(BLOCK)
        return {f"blocks.{i}.{k}": getattr(child, k) for k in ("ln1", "ln2", "attn", "ffn")}
    if isinstance(child, M6Head):
        return {"ln_f": child.ln_f}
    raise ValueError(f"--pp checkpoint: unknown pipeline child {name!r} ({type(child).__name__})")


def checkpoint_parts(run) -> nn.Module:
    """`run`'s (examples/m6/pipe.PipelineRun) stages on this rank, single-process names."""
    mesh = run.pipe.mesh
    layout = {"pp": mesh.size(0), "dp": mesh.size(1), "ep": mesh.size(2)}
    parts = ModelParts([], layout)
    for module in run.pipe.modules:
        for name, child in module.named_children():
            graft(parts, single_paths(name, child))
            if isinstance(child, M6Embed):  # the current object (FSDP2 swaps it for a DTensor)
                parts.register_parameter("pos_embed", child._parameters["pos_embed"])
    return parts


def stage_views(run) -> dict[int, nn.Module]:
    """{stage index: that stage's modules at their single-process paths} for this rank's
    stages with MoE layers (routing traces and rebalancing name layers as one process does)."""
    views = {}
    for s, module in zip(run.pipe.stage_indices, run.pipe.modules):
        view = nn.Module()
        for name, child in module.named_children():
            graft(view, single_paths(name, child))
        if moe_layers(view):
            views[s] = view
    return views
