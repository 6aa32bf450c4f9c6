"""The (dp, ep) DeviceMesh and the process groups parallel code reduces over."""

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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
