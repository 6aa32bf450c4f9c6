"""Interoperability with Hugging Face transformers (imported only by the caller's model)."""

from moe.interop.hf import HFMoELayer, from_hf, hf_blocks, to_hf
