"""Checkpoint I/O: sharded save and load that reload at another layout, with no pickle."""

from moe.checkpoint.load import load_checkpoint, read_manifest
from moe.checkpoint.manifest import CheckpointError
from moe.checkpoint.native import save_checkpoint
