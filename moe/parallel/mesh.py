"""The (dp, ep) DeviceMesh and the process groups parallel code reduces over."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moe.experts import GroupedExperts


def init_mesh(dp: int | None = None, ep: int = 1, device_type: str | None = None) -> DeviceMesh:
    """A 2-D DeviceMesh with dims ("dp", "ep") over the default process group.

    Ranks r and r+1 share a dp index and differ in ep index, so an EP group is ep consecutive
    ranks (inside one node when ep <= ranks per node). dp defaults to world_size // ep.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs torch.distributed initialised (launch with torchrun)")
    world = dist.get_world_size()
    if ep <= 0 or world % ep:
        raise ValueError(f"ep={ep} must be a positive divisor of the world size {world}")
    dp = world // ep if dp is None else dp
    if dp * ep != world:
        raise ValueError(f"dp={dp} x ep={ep} = {dp * ep} does not equal the world size {world}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters of every GroupedExperts: sharded over "ep", replicated over "dp"."""
    return [
        (f"{n}.{pn}" if n else pn, p)
        for n, m in model.named_modules()
        if isinstance(m, GroupedExperts)
        for pn, p in m.named_parameters(recurse=False)
    ]


def dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every other parameter: replicated on all ranks."""
    experts = {id(p) for _, p in expert_parameters(model)}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in experts]


def is_expert_parameter(model: nn.Module, param: torch.Tensor) -> bool:
    return any(p is param for _, p in expert_parameters(model))
