"""Expert replicas in training: the copies' gradients summed before the optimizer step.

A layer built with `MoEConfig.spare_slots = R` holds E + R expert slots; slot s holds a copy of
expert `expert_of_slot_S[s]` (moe.slots.layout), and the dispatch plan splits each expert's
kept pairs over its copies (moe.dispatch.replica_split). Each copy's weight gradient then
holds only its share of the rows; after the last backward of a step (all micro-batches under
gradient accumulation, after FSDP2's reduction under "ddp" or "fsdp"),

    moe.parallel.sum_replica_grads(model)
    optimizer.step()

gives every copy the expert's whole gradient: one all-reduce over all ranks of the model's
mesh (a pipeline stage's ranks under moe.pipeline) of a buffer
holding only the replicated experts' rows (each slot row contributed once: by its only holder
under "fsdp", by data-parallel replica 0 under "ddp"). Every copy keeps its own optimizer
state and steps on the same summed gradient, so copies stay bit-identical and training equals
the run without replicas (reduction order aside). Memory: R / W extra expert slots per rank,
each with its weights, gradient and optimizer state (AdamW in fp32: 16 bytes per parameter
with bf16 weights and fp32 masters). Bytes: the replicated experts' gradient rows, all-reduced.
Gradient clipping runs after this call: moe.parallel.clip_grad_norm_ counts each expert once
(extra_copies_power_sum takes the repeated copies out of the global norm).

Forgetting the call is an error, not drift: a layer with spare slots is pending from a
backward through it until this call, and any optimizer's step (a global torch step pre-hook)
or clip_grad_norm_ on a pending layer raises moe.slots.guard.ReplicaGradsNotSummed naming
it (moe/slots/guard.py), before anything changes; so does rebalance_experts. A second call
without a backward in between is a no-op; gradients accumulated on summed ones (a call per
micro-batch) and ranks holding different replica layouts are refused on every rank (one small
all-reduce of flags and layouts before the sum) before any gradient changes.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moe.layer import MoELayer, moe_layers
from moe.parallel.mesh import layers_group
from moe.shards import local
from moe.slots import guard as replica_guard
from moe.slots.layout import SlotLayout, with_copies


def _rows_here(layer: MoELayer) -> tuple[int, int, bool]:
    """(first slot, number of slots) this rank holds, and whether it contributes them: a rank
    whose coordinate on a replicated mesh dimension is not 0 holds a duplicate."""
    w1 = layer.experts.w1
    if not isinstance(w1, DTensor):
        return 0, w1.shape[0], True
    shape, offset = compute_local_shape_and_global_offset(w1.shape, w1.device_mesh, w1.placements)
    mesh = w1.device_mesh
    first = all(
        mesh.get_local_rank(d) == 0
        for d, p in enumerate(w1.placements)
        if isinstance(p, Replicate) and mesh.size(d) > 1
    )
    return offset[0], shape[0], first


def _jobs(layer: MoELayer, layout: SlotLayout) -> list:
    """(local grad, local rows, buffer rows, contributes, replicated experts) per trained
    expert parameter of `layer` (frozen ones hold no gradient and are left out)."""
    copies = layout.copies
    slots = layout.expert_of_slot
    index = {e: i for i, e in enumerate(e for e in range(len(copies)) if copies[e] > 1)}
    lo, n, contributes = _rows_here(layer)
    rows = [s - lo for s in range(lo, lo + n) if copies[slots[s]] > 1]
    at = [index[slots[s + lo]] for s in rows]
    return [
        (local(p.grad), rows, at, contributes, len(index))
        for p in layer.experts.parameters()
        if p.requires_grad
    ]


_MIXED = (
    "gradients were accumulated on top of summed ones (a backward after sum_replica_grads "
    "without zeroing them); call sum_replica_grads once, after the last backward of the step "
    "(zero the gradients and redo the step)"
)
_MISSING = (
    "sum_replica_grads needs every expert gradient; call it after backward (all ranks), "
    "before optimizer.step()"
)


def _verdicts(layers) -> tuple[list[str], list[str], list[str]]:
    """Each replicated layer's replica_guard.sum_verdict, and the layers (names) whose
    gradients were accumulated after a sum, or are missing."""
    verdicts, mixed, missing = [], [], []
    for name, layer in layers:
        verdict = replica_guard.sum_verdict(layer)
        verdicts.append(verdict)
        if verdict == "mixed":
            mixed.append(name)
        elif verdict == "sum" and any(
            p.grad is None for p in layer.experts.parameters() if p.requires_grad
        ):
            missing.append(name)
    return verdicts, mixed, missing


def _raise(mixed: int, missing: int, names: list[str]) -> None:
    here = f" (here: {', '.join(names[:8])})" if names else ""
    if mixed:
        raise replica_guard.ReplicaGradsNotSummed(f"sum_replica_grads{here}: {_MIXED}")
    if missing:
        raise ValueError(f"sum_replica_grads{here}: {_MISSING}")


def _agree(layers, verdicts, mixed, missing, split: bool, device) -> bool:
    """The same decision on every rank before any gradient changes: raises the same error
    when any rank found a problem, the ranks' slot layouts differ (e.g. a state-dict load on
    one rank) or they disagree on whether there is anything to sum; True to sum."""
    noop = all(v == "noop" for v in verdicts)
    if not split:
        _raise(len(mixed), len(missing), mixed or missing)
        return not noop
    slots = torch.cat([layer.expert_of_slot_S for _, layer in layers]).to(device)
    flags = [int(bool(mixed)), int(bool(missing)), int(noop)]
    packed = torch.cat([torch.tensor(flags, device=device), slots, slots * slots])
    group = layers_group(layers)
    dist.all_reduce(packed, group=group)
    world, n = dist.get_world_size(group), slots.numel()
    summed, squares = packed[3 : 3 + n], packed[3 + n :]
    counts = packed[:3].tolist()  # step-time host read
    _raise(counts[0], counts[1], mixed or missing)
    if not torch.equal(summed * summed, world * squares):
        raise ValueError(
            "sum_replica_grads: ranks hold different replica layouts (expert_of_slot_S), e.g. "
            "after a state-dict load on some ranks; nothing changed (load the same state on "
            "every rank, or through moe.checkpoint)"
        )
    if 0 < counts[2] < world:
        raise replica_guard.ReplicaGradsNotSummed(
            "sum_replica_grads: some ranks' gradients were summed already and others' not; "
            "nothing changed"
        )
    return not noop


@torch.no_grad()
def sum_replica_grads(model: nn.Module) -> int:
    """Sum each replicated expert's weight gradients over its copies, in place, on every rank
    (collective when the experts are split over ranks: call it on every rank, after the last
    backward of the step and before clipping and optimizer.step()). A second call without a
    backward in between is a no-op; gradients accumulated on top of summed ones are refused
    (moe.slots.guard). Returns the gradient bytes this rank contributed to the all-reduce
    (0 without replicas or with nothing to sum)."""
    layers = with_copies(moe_layers(model))  # a layout without copies has nothing to sum
    if not layers:
        return 0
    verdicts, mixed, missing = _verdicts(layers)
    split = dist.is_initialized() and any(isinstance(p.grad, DTensor) for p in model.parameters())
    device = layers[0][1].expert_of_slot_S.device
    if not _agree(layers, verdicts, mixed, missing, split, device):
        return 0
    jobs = [j for _, layer in layers for j in _jobs(layer, layer.slot_layout())]
    sizes = [n_rep * grad[0].numel() if grad.shape[0] else 0 for grad, *_, n_rep in jobs]
    if not jobs:  # every expert frozen: nothing to sum
        for _, layer in layers:
            layer.replica_grads_summed()
        return 0
    device = jobs[0][0].device
    dtype = torch.promote_types(jobs[0][0].dtype, torch.float32)
    for grad, *_ in jobs:
        dtype = torch.promote_types(dtype, grad.dtype)
    buffer = torch.zeros(sum(sizes), dtype=dtype, device=device)
    views, offset = [], 0
    for (grad, rows, at, contributes, n_rep), size in zip(jobs, sizes):
        view = buffer[offset : offset + size].view(n_rep, *grad.shape[1:])
        offset += size
        if rows and contributes:
            idx = torch.tensor(rows, device=device)
            view.index_add_(0, torch.tensor(at, device=device), grad[idx].to(dtype))
        views.append(view)
    if split:
        dist.all_reduce(buffer, group=layers_group(layers))
    for (grad, rows, at, _, _), view in zip(jobs, views):
        if rows:
            idx = torch.tensor(rows, device=device)
            grad[idx] = view[torch.tensor(at, device=device)].to(grad.dtype)
    for _, layer in layers:
        layer.replica_grads_summed()
    return buffer.numel() * buffer.element_size()


@torch.no_grad()
def extra_copies_power_sum(model: nn.Module, norm_type: float) -> torch.Tensor | None:
    """sum |g|^p over the gradient rows of every copy but each expert's first (after
    sum_replica_grads they repeat the first copy's): what a global norm must not count twice.
    None without replicas; collective (one all-reduce) when the experts are split over ranks."""
    parts, device, wide = [], None, torch.float32
    layers = with_copies(moe_layers(model))
    for _, layer in layers:
        first = set(layer.slot_layout().slot_of_expert)
        lo, n, contributes = _rows_here(layer)
        rows = [s - lo for s in range(lo, lo + n) if s not in first] if contributes else []
        for p in layer.experts.parameters():
            if p.grad is None:
                continue
            grad = local(p.grad)
            device = grad.device
            wide = torch.promote_types(wide, grad.dtype)
            if rows:
                picked = grad[torch.tensor(rows, device=device)]
                picked = picked.to(torch.promote_types(picked.dtype, torch.float32))
                parts.append(picked.norm(norm_type).pow(norm_type))
    if device is None:
        return None
    total = torch.zeros((), dtype=wide, device=device)
    for part in parts:
        total = total + part.to(wide)
    if dist.is_initialized() and any(isinstance(p.grad, DTensor) for p in model.parameters()):
        dist.all_reduce(total, group=layers_group(layers))
    return total
