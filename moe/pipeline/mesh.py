"""The 3-D ("pp", "dp", "ep") mesh: one (dp, ep) mesh per pipeline stage."""

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "ep")


def init_pipeline_mesh(
    pp: int, dp: int | None = None, ep: int = 1, device_type: str | None = None
) -> DeviceMesh:
    """A DeviceMesh with dims ("pp", "dp", "ep") over the default process group: stage s holds
    the dp * ep consecutive ranks from s * dp * ep, an EP group is ep consecutive ranks inside
    it, and the ranks of one (dp, ep) coordinate form a pipeline (its "pp" group)."""
    if not dist.is_initialized():
        raise RuntimeError("init_pipeline_mesh needs torch.distributed initialised")
    world = dist.get_world_size()
    for name, value in (("pp", pp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if world % (pp * ep):
        raise ValueError(f"pp={pp} x ep={ep} does not divide the world size {world}")
    dp = world // (pp * ep) if dp is None else dp
    if pp * dp * ep != world:
        raise ValueError(
            f"pp={pp} x dp={dp} x ep={ep} = {pp * dp * ep} is not the world size {world}"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (pp, dp, ep), mesh_dim_names=MESH_DIMS)


def check_pipeline_mesh(mesh) -> None:
    if not isinstance(mesh, DeviceMesh) or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(f"the pipeline needs a mesh with dims {MESH_DIMS}, got {names!r}")
