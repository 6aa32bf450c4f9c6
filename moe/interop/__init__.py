"""Interoperability with Hugging Face transformers (imported only by the caller's model)."""

from moe.interop.hf import HFMoELayer, from_hf, hf_blocks, to_hf
from moe.interop.hf_experts import register_experts_implementation
from moe.interop.hf_checkpoint import HFCheckpointError, load_hf_checkpoint
from moe.interop.hf_save import save_hf_checkpoint
from moe.interop.peft import to_peft
from moe.interop.peft_files import PeftAdapterError
from moe.interop.peft_read import from_peft, peft_lora_config
