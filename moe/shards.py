"""This rank's shard of a parameter: the one `to_local` helper (imports nothing from moe).

`parallelize` turns expert weights into DTensors (sharded over ep, or replicated); elementwise
and foreach work, the kernels and the rebalancer act on the local shard.
"""

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The local shard of a DTensor; a plain tensor (or None) as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`local` of each (foreach ops cannot mix DTensors of different meshes)."""
    return [local(t) for t in tensors]


def dtensor_like(local_t: torch.Tensor, like: DTensor) -> DTensor:
    """`local_t` (this rank's shard, of `like`'s local shape) as a DTensor with `like`'s mesh,
    placements, global shape and stride, sharing local_t's storage (no communication)."""
    return DTensor.from_local(
        local_t,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
