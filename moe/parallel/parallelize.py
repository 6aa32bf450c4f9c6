"""parallelize(): expert parallelism over the mesh's "ep" dim, data parallelism over the rest,
applied from outside a model that was written for one device."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe.comm.consistency import check_same_across_ranks
from moe.dispatch import ExpertParallelDispatcher
from moe.layer import moe_layers
from moe.parallel.grad_sync import GradientReducer
from moe.parallel.mesh import dense_parameters, expert_parameters


def _check_config(model: nn.Module, mesh: DeviceMesh, ranks_per_node: int | None) -> None:
    """Every rank must build the same MoE layers with the same mesh: compare before any
    exchange, so a mismatch is an error on every rank instead of a hang."""
    ep = mesh.size(mesh.mesh_dim_names.index("ep"))
    values = {
        "ep": ep,
        "dp": mesh.size(mesh.mesh_dim_names.index("dp")),
        "moe_layers": len(moe_layers(model)),
        "ranks_per_node": -1 if ranks_per_node is None else ranks_per_node,
    }
    for name, layer in moe_layers(model):
        c = layer.config
        if layer.experts.num_experts != c.num_experts:
            raise ValueError(f"{name}: already parallelized")
        if c.num_experts % ep:
            raise ValueError(f"{name}: num_experts={c.num_experts} is not divisible by ep={ep}")
        for field in ("num_experts", "top_k", "d_model", "d_ff"):
            values[f"{name}.{field}"] = getattr(c, field)
    check_same_across_ranks(values)


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
    if tuple(mesh.mesh_dim_names) != ("dp", "ep"):
        raise ValueError(f"mesh dims must be ('dp', 'ep'), got {mesh.mesh_dim_names}")
    if not moe_layers(model):
        raise ValueError("parallelize: the model has no MoELayer")
    _check_config(model, mesh, ranks_per_node)
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
