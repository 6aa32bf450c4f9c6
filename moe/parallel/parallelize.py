"""parallelize(): expert parallelism over the mesh's "ep" dim, data parallelism over the rest,
applied from outside a model that was written for one device."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe.dispatch import ExpertParallelDispatcher
from moe.layer import moe_layers
from moe.parallel.config_check import check_config
from moe.parallel.grad_sync import GradientReducer
from moe.parallel.mesh import dense_parameters, expert_parameters


def _shard_experts(layer, ep_rank: int, ep: int) -> None:
    experts = layer.experts
    local = experts.num_experts // ep
    first = ep_rank * local
    for pname, p in list(experts.named_parameters(recurse=False)):
        shard = nn.Parameter(
            p.detach()[first : first + local].clone(), requires_grad=p.requires_grad
        )
        setattr(experts, pname, shard)
    experts.expert_offset = first


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    algorithm: str = "auto",
    ranks_per_node: int | None = None,
    bucket_mb: float = 25.0,
    grad_dtype: torch.dtype | None = None,
    sync_params: bool = True,
) -> nn.Module:
    """Shard every MoELayer's experts over mesh["ep"] (global expert e lives on ep rank
    e // (E / ep)), install the all-to-all exchange (flat, hierarchical or auto), keep routers
    and dense parameters replicated, and reduce gradients by the time backward() returns.

    sync_params broadcasts rank 0's parameters first, so every rank starts from one model.
    grad_dtype (e.g. torch.bfloat16) communicates gradients in lower precision.
    """
    check_config(model, mesh, ranks_per_node)  # same error on every rank, before any exchange
    if sync_params:
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor, src=0)
    ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
    ep, ep_rank = dist.get_world_size(ep_group), mesh.get_local_rank("ep")
    for _, layer in moe_layers(model):
        _shard_experts(layer, ep_rank, ep)
        layer.dispatcher = ExpertParallelDispatcher(
            ep_group, layer.experts.num_experts, algorithm, ranks_per_node, layer.config.backend
        )
        layer.router.load_group = dist.group.WORLD  # observed load summed over all ranks
    reducer = GradientReducer(
        [p for _, p in dense_parameters(model) if p.requires_grad],  # frozen: nothing to reduce
        [p for _, p in expert_parameters(model) if p.requires_grad],
        dp_group,
        dist.get_world_size(),
        bucket_mb,
        grad_dtype,
    )
    model._moe_grad_reducer = reducer
    model._moe_mesh = mesh
    return model
