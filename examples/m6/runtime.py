"""Runtime: where one process of a run works (rank, world, device, mesh, autocast)."""

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch


@dataclass
class Runtime:
    """This process's rank in a world of `world` ranks, its device, the ("dp", "ep") mesh
    (None in a single process) and the autocast context of its forward passes."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object = None
    autocast: object = field(default_factory=nullcontext)
