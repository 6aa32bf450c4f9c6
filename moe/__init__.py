"""moe: sparse mixture-of-experts layers and their training at scale.

Tensor names end in their shape (x_TD: tokens x d_model); docs/shapes.md is the legend (T
tokens, D d_model, F d_ff, E all experts, L this rank's experts, K top-k, C capacity, M
dispatch pairs, R rows the experts compute, W ranks).
"""

from moe import comm, dispatch, gating, kernels
from moe.config import MoEConfig
from moe.convert import ConversionError, swap_ffn
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
