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
