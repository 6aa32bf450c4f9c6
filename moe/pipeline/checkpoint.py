"""Checkpoints of a Pipeline: moe.checkpoint's save_checkpoint / load_checkpoint take the
Pipeline itself (or any (dp, ep)-parallelized or one-process model) and write one format, so a
checkpoint saved at any (pp, dp, ep) loads at any other, optimizer state included.

This rank's stages are checkpointed as one module (moe.checkpoint.parts.ModelParts) holding
their children under their names in the whole model, so keys and global shapes are the
single-process ones on every stage and one optimizer over Pipeline.parameters() (a torch
optimizer or GroupedApply) maps onto them; the run's (pp, dp, ep) is recorded with it.
"""

from torch import nn

from moe.checkpoint.parts import ModelParts


def stage_parts(pipe) -> nn.Module:
    """`pipe`'s stages on this rank as one module, with the layout of its mesh."""
    mesh = pipe.mesh
    layout = {"pp": mesh.size(0), "dp": mesh.size(1), "ep": mesh.size(2)}
    return ModelParts(pipe.modules, layout)
