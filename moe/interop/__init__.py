"""Interoperability with Hugging Face transformers (imported only by the caller's model)."""

from moe.interop.hf import HFMoELayer, from_hf, hf_blocks, to_hf
from moe.interop.hf_checkpoint import HFCheckpointError, load_hf_checkpoint, save_hf_checkpoint
