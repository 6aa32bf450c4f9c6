"""The (dp, ep) DeviceMesh and the process groups parallel code reduces over.

`parallelize` acts on the ranks of the mesh it is given, never the world (a pipeline stage
passes its own mesh["dp", "ep"]): its agreement check, its parameter broadcast and the
routers' load statistics use `mesh_group(mesh)`, all of the mesh's ranks.
"""

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


def mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of all of `mesh`'s ranks (its dims flattened, named by joining the
    dim names with "_", as parallelize names it): what acts on the mesh and not the world.
    Every rank of the root mesh must call it at the same point (DeviceMesh creates the
    flattened groups of every slice)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if not mesh.mesh_dim_names:
        raise ValueError("mesh must have named dims, e.g. ('dp', 'ep') (moe.parallel.init_mesh)")
    return mesh._flatten("_".join(mesh.mesh_dim_names)).get_group()


def describe_mesh(mesh: DeviceMesh) -> str:
    """E.g. "mesh ('dp', 'ep') = (1, 2) of global ranks [2, 3] (rank i below: its i-th)":
    how errors name the mesh, its rank numbers being positions in it."""
    shape = tuple(mesh.mesh.shape)
    ranks = mesh.mesh.flatten().tolist()
    return (
        f"mesh {tuple(mesh.mesh_dim_names or ())} = {shape} of global ranks {ranks} "
        "(rank i below: its i-th)"
    )


def layers_group(layers) -> dist.ProcessGroup | None:
    """The process group of the mesh the MoE layers `[(name, layer)]` were parallelized on
    (None: no layer was): what collectives over a model's experts use, so they act on its
    mesh's ranks only (a pipeline stage's), never the world. Layers on different meshes are
    a ValueError naming two of them."""
    meshes = [(name, layer.mesh) for name, layer in layers if layer.mesh is not None]
    if not meshes:
        return None
    for name, mesh in meshes[1:]:
        if mesh is not meshes[0][1] and mesh.mesh.tolist() != meshes[0][1].mesh.tolist():
            raise ValueError(
                f"MoE layers {meshes[0][0]!r} and {name!r} are on different meshes "
                f"({describe_mesh(meshes[0][1])}; {describe_mesh(mesh)}): call this on one "
                "model (one pipeline stage) at a time"
            )
    return mesh_group(meshes[0][1])
