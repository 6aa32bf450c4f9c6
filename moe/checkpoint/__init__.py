"""Checkpoint I/O: sharded save and load that reload at another layout, with no pickle."""

from moe.checkpoint.native import load_checkpoint, save_checkpoint
