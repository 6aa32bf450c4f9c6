"""Copies whose gradients were not summed are refused at the optimizer step.

A layer with spare slots (MoEConfig.spare_slots) holds copies of experts; after backward each
copy's gradient holds only its share of the rows until moe.parallel.sum_replica_grads adds
them up. A step without that sum would move the copies apart silently. So every such layer
marks itself pending when a backward reaches its output, sum_replica_grads clears
the mark, and a global torch optimizer step pre-hook (registered once, the first time a
layer with spare slots is built; torch.optim.optimizer.register_optimizer_step_pre_hook)
raises before any optimizer - torch's or moe.memory.GroupedApply - steps parameters of a
pending layer; moe.parallel.clip_grad_norm_ raises as well (clip after the sum). Gradient
accumulation is unaffected: any number of forwards and backwards, then one sum.
"""

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

_LAYERS: "weakref.WeakSet" = weakref.WeakSet()
_HOOK = []  # the one global hook's handle, once registered


class ReplicaGradsNotSummed(RuntimeError):
    """An optimizer step or gradient clip on expert copies whose gradients were not summed."""


def watch(layer) -> None:
    """Check `layer` (one with spare slots) at every optimizer step from now on."""
    _LAYERS.add(layer)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _message(names: list[str], what: str) -> str:
    return (
        f"{what}: the expert copies of {', '.join(names[:8])} hold unsummed gradients; call "
        "moe.parallel.sum_replica_grads(model) on every rank after the last backward of the "
        "step, before clipping and optimizer.step()"
    )


def _before_step(optimizer, args, kwargs) -> None:
    pending = [layer for layer in list(_LAYERS) if layer.replica_grads_pending]
    if not pending:
        return
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = [
        layer.name for layer in pending if any(id(p) in ids for p in layer.experts.parameters())
    ]
    if names:
        raise ReplicaGradsNotSummed(_message(names, f"{type(optimizer).__name__}.step"))


def check_summed(named_layers, what: str) -> None:
    """Raise ReplicaGradsNotSummed naming the (name, layer) pairs still pending."""
    names = [name for name, layer in named_layers if layer.replica_grads_pending]
    if names:
        raise ReplicaGradsNotSummed(_message(names, what))
