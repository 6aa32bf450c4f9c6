"""Conversion of dense models: swap FFNs for MoE layers (swap.py), recognise the FFNs
(ffn_match.py), and save / check / re-apply the settings of a swap (saved_settings.py)."""

from moe.convert.ffn_match import ConversionError
from moe.convert.saved_settings import check_moe_settings, save_moe_settings, swap_ffn_from_settings
from moe.convert.swap import swap_ffn

__all__ = [
    "ConversionError",
    "check_moe_settings",
    "save_moe_settings",
    "swap_ffn",
    "swap_ffn_from_settings",
]
