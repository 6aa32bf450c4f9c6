"""The pending-gradient state of a layer's expert copies: one state machine that every entry
point (optimizer step, sum_replica_grads, clip_grad_norm_, rebalance_experts) consults.

A layer with expert copies (spare slots) holds, after backward, only each copy's share of the
expert's gradient until moe.parallel.sum_replica_grads adds them up. States of one layer:

    clean    -- no gradient arrived since the last sum or optimizer step
    pending  -- a backward reached the layer's expert gradients since then: a step, a clip or a
                rebalance now would use (or move) partial gradients, so each raises
                ReplicaGradsNotSummed (steps: a global torch optimizer step pre-hook,
                torch.optim.optimizer.register_optimizer_step_pre_hook, which GroupedApply
                calls as well), and sum_replica_grads sums
    summed   -- sum_replica_grads ran; a second call is a no-op (not a second sum), and
                gradients accumulated on top of summed ones (a sum per micro-batch) are refused
                by the next sum: they cannot be told apart any more

"A backward arrived" is seen two ways: eagerly, the layer's output marks it in backward
(moe.backward_watch); under torch.compile, where that mark is not traced, by the expert
gradients themselves changing (a new tensor or an in-place accumulation since the record
taken at the last sum or step). Frozen experts (no parameter requiring grad) never pend.
Gradient accumulation is unaffected: any number of forwards and backwards, then one sum.
"""

import weakref
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from moe.shards import local

_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer -> _Record
_HOOKS = []  # the global step hooks' handles, once registered


class ReplicaGradsNotSummed(RuntimeError):
    """An optimizer step, gradient clip or rebalance on expert copies whose gradients were not
    summed, or a sum of gradients accumulated on top of summed ones."""


@dataclass
class _Record:
    arrived: bool = False  # eager: a backward reached the layer since the last sum / step
    summed: bool = False  # sum_replica_grads ran since the last optimizer step
    grads: list | None = field(default=None)  # (weakref, version) of each gradient then


def watch(layer, layout):
    """Track `layer` from now on if its slot layout (moe.slots.layout.SlotLayout) holds copies;
    returns the mark its eager forward hands to the backward (None without copies: nothing to
    sum, nothing tracked, no step hook)."""
    if not layout.has_copies:
        return None
    _LAYERS.setdefault(layer, _Record())
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_before_step))
        _HOOKS.append(register_optimizer_step_post_hook(_after_step))
    ref = weakref.ref(layer)

    def mark() -> None:  # a backward reached the layer: its copies' gradients are to sum
        watched = ref()
        if watched is not None:
            grads_arrived(watched)

    return mark


def traced(layer) -> None:
    """torch.compile traced a training forward of `layer`, where the eager mark does not run:
    from now on its copies' gradients are watched instead (no-op for an untracked layer)."""
    if layer.replica_mark is not None:
        layer.ran_compiled = True


def _record(layer) -> _Record:
    return _LAYERS.setdefault(layer, _Record())


def _trained(layer) -> list:
    return [p for p in layer.experts.parameters() if p.requires_grad]


def _grads(layer) -> list:
    """The local gradient tensors themselves (no_grad: DTensor.to_local returns its local
    tensor, not a new view, so identity and version say whether it was written)."""
    with torch.no_grad():
        return [local(p.grad) for p in _trained(layer)]


def _snapshot(layer) -> list:
    return [None if g is None else (weakref.ref(g), g._version) for g in _grads(layer)]


def _same_tensor(entry, g) -> bool:
    return entry is not None and g is not None and entry[0]() is g


def _changed(layer, rec: _Record) -> bool:
    """Whether any expert gradient is new or was written since the record."""
    now = _grads(layer)
    if rec.grads is None or len(rec.grads) != len(now):
        return any(g is not None for g in now)
    return any(
        g is not None and not (_same_tensor(e, g) and e[1] == g._version)
        for e, g in zip(rec.grads, now)
    )


def grads_arrived(layer) -> None:
    """Eager backward mark: a backward reached `layer`'s output."""
    if _trained(layer):
        _record(layer).arrived = True


def pending(layer) -> bool:
    """Whether `layer`'s expert copies hold gradients that were not summed."""
    rec = _LAYERS.get(layer)
    if rec is None or all(p.grad is None for p in _trained(layer)):
        return False  # frozen experts, or gradients zeroed to None: nothing to sum
    compiled = getattr(layer, "ran_compiled", False)  # traced: its backward marks do not run
    return rec.arrived or (compiled and _changed(layer, rec))


def sum_verdict(layer) -> str:
    """What sum_replica_grads must do for `layer`: "sum", "noop" (nothing arrived since the
    last sum or step), or "mixed" (gradients accumulated on top of summed ones)."""
    rec = _record(layer)
    if not pending(layer):
        return "sum" if rec.grads is None else "noop"
    if rec.summed and rec.grads is not None:
        now = _grads(layer)
        if any(_same_tensor(e, g) for e, g in zip(rec.grads, now)):
            return "mixed"
    return "sum"


def summed(layer) -> None:
    """sum_replica_grads summed the copies' gradients: steps may run."""
    rec = _record(layer)
    rec.arrived, rec.summed, rec.grads = False, True, _snapshot(layer)


def still_summed(layers) -> None:
    """Summed gradients were rewritten in place (moe.parallel.clip_grad_norm_ scaled them,
    rebalance_experts moved their rows): still summed, not a new backward."""
    for layer in layers:
        rec = _LAYERS.get(layer)
        if rec is not None and not rec.arrived:
            rec.grads = _snapshot(layer)


def _optimizer_layers(optimizer, layers) -> list:
    """The `layers` whose expert parameters `optimizer` updates."""
    if not layers:
        return []
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [layer for layer in layers if any(id(p) in ids for p in layer.experts.parameters())]


def _before_step(optimizer, args, kwargs) -> None:
    waiting = [layer for layer in list(_LAYERS) if pending(layer)]
    names = [layer.name for layer in _optimizer_layers(optimizer, waiting)]
    if names:
        raise ReplicaGradsNotSummed(message(names, f"{type(optimizer).__name__}.step"))


def _after_step(optimizer, args, kwargs) -> None:
    """The step consumed the gradients: the next ones belong to a new step."""
    for layer in _optimizer_layers(optimizer, list(_LAYERS)):
        rec = _record(layer)
        rec.arrived, rec.summed, rec.grads = False, False, _snapshot(layer)


def message(names: list[str], what: str) -> str:
    return (
        f"{what}: the expert copies of {', '.join(names[:8])} hold unsummed gradients; call "
        "moe.parallel.sum_replica_grads(model) on every rank after the last backward of the "
        "step, before clipping, rebalance_experts and optimizer.step()"
    )


def check_summed(named_layers, what: str) -> None:
    """Raise ReplicaGradsNotSummed naming the (name, layer) pairs still pending."""
    names = [name for name, layer in named_layers if pending(layer)]
    if names:
        raise ReplicaGradsNotSummed(message(names, what))
