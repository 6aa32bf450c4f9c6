"""Gradient clipping by global norm that is correct under expert x data parallelism.

After parallelize() every gradient is a DTensor: its norm is computed per device mesh with
DTensor's own reductions (sharded dims summed, replicated dims counted once). For models sharded
by hand (plain tensors), dense parameters are replicated on every rank, so their squared
gradient sum is the same everywhere and counted once. Each expert lives on exactly one rank of an EP group (and is
replicated over DP with identical gradients), so expert sums are all-reduced over "ep" only:
reducing over DP too would count every expert once per replica.
"""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moe.experts import dense_parameters, expert_parameters
from moe.layer import moe_layers
from moe.memory.grouped_apply import GroupedApply
from moe.parallel.replicas import extra_copies_power_sum
from moe.slots import guard as replica_guard
from moe.slots.guard import check_summed


def _power_sum(grads: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """sum |g|^p (or max |g| for p = inf) over `grads` in fp32 (fp64 if any is), 0-dim."""
    if not grads:
        return torch.zeros((), device=device)
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=wide))
    return norms.amax() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def _dtensor_power_sum(grads: list[DTensor], norm_type: float, device) -> torch.Tensor:
    """sum |g|^p (max for inf) over DTensor gradients, one reduction per device mesh (DTensor
    sums over sharded mesh dims and counts replicated ones once); a plain 0-dim tensor."""
    by_mesh: dict[int, list[DTensor]] = {}
    for g in grads:  # same parameter order on every rank: the same collectives
        by_mesh.setdefault(id(g.device_mesh), []).append(g)
    total = torch.zeros((), device=device)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        part = norm.float() if math.isinf(norm_type) else norm.float().pow(norm_type)
        total = torch.maximum(total, part) if math.isinf(norm_type) else total + part
    return total


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    mesh=None,
    *,
    norm_type: float = 2.0,
    optimizer=None,
) -> torch.Tensor:
    """Scale every gradient of `model` by min(1, max_norm / (total_norm + 1e-6)); return the
    total norm (a 0-dim fp32 tensor; reading it is the caller's host sync).

    mesh: the ("dp", "ep") mesh; None (or no torch.distributed) computes the local norm.
    optimizer: a GroupedApply; its pending factor (fp16 loss scale) is taken into account
    and the clip factor is handed to it instead of rescaling low-precision grads in place.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    check_summed(moe_layers(model), "clip_grad_norm_")  # replicas
    norm_type = float(norm_type)
    grouped = isinstance(optimizer, GroupedApply)
    if grouped and optimizer.loss_scaler is not None:
        optimizer.unscale_()
    dense = [p.grad for _, p in dense_parameters(model) if p.grad is not None]
    expert = [p.grad for _, p in expert_parameters(model) if p.grad is not None]
    device = (dense + expert)[0].device if dense + expert else torch.device("cpu")
    dtensors = [g for g in dense + expert if isinstance(g, DTensor)]
    if dtensors:  # DTensor gradients (parallelize): plain ones would be counted wrongly
        dense = [g for g in dense if not isinstance(g, DTensor)]
        expert = [g for g in expert if not isinstance(g, DTensor)]
        if dense or expert:
            raise ValueError("clip_grad_norm_: mix of DTensor and plain gradients")
    dense_sum = _dtensor_power_sum(dtensors, norm_type, device)
    dense_sum = dense_sum + _power_sum(dense, norm_type, device)
    expert_sum = _power_sum(expert, norm_type, device)
    if not dtensors and mesh is not None and dist.is_available() and dist.is_initialized():
        group = mesh.get_group("ep")
        if dist.get_world_size(group) > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(expert_sum, op=op, group=group)
    if math.isinf(norm_type):
        total = torch.maximum(dense_sum, expert_sum)
    else:
        # expert replicas (after sum_replica_grads): each expert's norm counted once
        copies = extra_copies_power_sum(model, norm_type)
        if copies is not None:
            expert_sum = expert_sum - copies.to(expert_sum.device)
        total = (dense_sum + expert_sum).pow(1.0 / norm_type)
    pending = optimizer.pending_grad_factor if grouped else None
    if pending is not None:
        total = total * pending
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if grouped:
        optimizer.mul_grads_(coef)
    elif dtensors:
        for g in dtensors:
            g.mul_(coef.to(device))
    elif dense + expert:
        torch._foreach_mul_(dense + expert, coef.to(device))
    replica_guard.still_summed(layer for _, layer in moe_layers(model))  # still summed
    return total
