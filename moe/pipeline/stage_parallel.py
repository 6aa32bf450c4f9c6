"""EP + FSDP2 on one pipeline stage, over the stage's own ("dp", "ep") mesh only.

Each child of the stage (its `units()`; a stage of Rooted children names the modules at
their paths, each called in the forward) that holds an MoE layer is parallelized by
moe.parallel.parallelize on the stage's mesh (its MoE layers and the child become FSDP2
units, as parallelize(stage, blocks=...) would make them); every other child with parameters
and then the stage itself are FSDP2 units (fully_shard or replicate) over the stage's ranks. A stage
with no MoE layer never calls parallelize: it joins no MoE collective.

parallelize acts on the ranks of the mesh it is given only (its agreement check, its broadcast,
the routers' load group), so each stage checks and reduces over its own ranks. It is called
with sync_params=False: the pipeline broadcasts each whole stage, dense children included,
from the stage's first rank itself (broadcast_in_stage). The dense units take parallelize's
mp_policy / grad_dtype, offload_policy and reshard_after_forward.
"""

from dataclasses import fields, is_dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

from moe.layer import moe_layers
from moe.parallel import parallelize

_REFUSED = ("sync_params", "blocks")  # the pipeline decides these


def parallel_keywords(parallel) -> dict:
    """parallelize()'s settings as keywords: a dict of them, a ParallelConfig (any settings
    dataclass with those fields) or {"config": ParallelConfig}; the config's sync_params is
    replaced by the pipeline's own."""
    if parallel is None:
        return {}
    if isinstance(parallel, dict) and "config" in parallel:
        if len(parallel) > 1:
            raise ValueError(f"parallel: give config or keywords, not both, got {sorted(parallel)}")
        return parallel_keywords(parallel["config"])
    if is_dataclass(parallel) and not isinstance(parallel, type):
        given = {f.name: getattr(parallel, f.name) for f in fields(parallel)}
        return {k: v for k, v in given.items() if k != "sync_params" and v is not None}
    if not isinstance(parallel, dict):
        raise ValueError(f"parallel must be a dict of parallelize() keywords, got {parallel!r:.80}")
    return dict(parallel)


def check_parallel_kwargs(parallel: dict) -> None:
    for key in _REFUSED:
        if key in parallel:
            raise ValueError(
                f"parallel={{{key!r}: ...}}: the pipeline sets {key} itself "
                "(PipelineConfig.sync_params broadcasts within each stage; blocks are the "
                "stage's children)"
            )
    data_parallel = parallel.get("data_parallel", "ddp")
    if data_parallel not in ("ddp", "fsdp"):
        raise ValueError(f"data_parallel must be 'ddp' or 'fsdp', got {data_parallel!r}")


def stage_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """All ranks of the stage's ("dp", "ep") mesh (flattened as parallelize names it)."""
    return mesh._flatten("dp_ep").get_group()


@torch.no_grad()
def broadcast_in_stage(stage: nn.Module, mesh: DeviceMesh) -> None:
    """The stage's first rank's parameters and buffers on every rank of the stage."""
    group = stage_group(mesh)
    for tensor in [*stage.parameters(), *stage.buffers()]:
        dist.broadcast(tensor, group=group, group_src=0)


def _dense_wrap(parallel: dict):
    mp_policy = parallel.get("mp_policy")
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(reduce_dtype=parallel.get("grad_dtype"))
    common = {
        "mp_policy": mp_policy,
        "offload_policy": parallel.get("offload_policy") or OffloadPolicy(),
    }
    if parallel.get("data_parallel", "ddp") != "fsdp":
        return replicate, common
    return fully_shard, {
        **common,
        "reshard_after_forward": parallel.get("reshard_after_forward", True),
    }


def parallelize_stage(stage: nn.Module, mesh: DeviceMesh, parallel: dict) -> nn.Module:
    """EP + FSDP2 on `stage` over `mesh` (the stage's ("dp", "ep") mesh); `parallel`:
    parallelize()'s keywords (data_parallel, algorithm, grad_dtype, ...)."""
    check_parallel_kwargs(parallel)
    flat = mesh._flatten("dp_ep")
    wrap, common = _dense_wrap(parallel)
    sum_only = dist.get_backend() != "nccl"  # gloo: no AVG / PREMUL_SUM (as parallelize)
    units = []
    pieces = stage.units() if hasattr(stage, "units") else list(stage.children())
    for child in pieces:
        if moe_layers(child):
            parallelize(child, mesh, sync_params=False, **parallel)
        elif any(True for _ in child.parameters()):
            units.append(child)
    for module in [*units, stage]:
        wrap(module, mesh=flat, **common)
        module.set_force_sum_reduction_for_comms(sum_only)
    return stage
