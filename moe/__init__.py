"""moe: sparse mixture-of-experts layers and their training at scale."""

from moe import comm, dispatch, gating, kernels
from moe.config import MoEConfig
from moe.convert import swap_ffn
from moe.ffn_match import ConversionError
from moe.experts import GroupedExperts
from moe.layer import MoELayer, aux_loss, moe_layers, update_router_biases
from moe import parallel  # after the layer: parallel builds on it

__all__ = [
    "ConversionError",
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "aux_loss",
    "dispatch",
    "gating",
    "kernels",
    "moe_layers",
    "parallel",
    "swap_ffn",
    "update_router_biases",
]
__version__ = "0.1.0"
