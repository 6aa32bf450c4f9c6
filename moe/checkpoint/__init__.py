"""Checkpoint I/O on torch.distributed.checkpoint: each rank writes its own shards, any layout
loads at any other, atomic commit, JSON metadata and raw bytes (no pickle anywhere)."""

from moe.checkpoint.api import checkpoint_dir, load_checkpoint, save_checkpoint
from moe.checkpoint.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "checkpoint_dir",
    "load_checkpoint",
    "save_checkpoint",
]
