"""moe: sparse mixture-of-experts layers and their training at scale.

Tensor names end in their shape (x_TD: tokens x d_model); docs/shapes.md is the legend (T
tokens, D d_model, F d_ff, E all experts, L this rank's experts, K top-k, C capacity, M
dispatch pairs, R rows the experts compute, W ranks).
"""

import importlib

from moe import comm, dispatch, gating, kernels
from moe.config import MoEConfig
from moe.experts import GroupedExperts
from moe.gating.balance import reset_global_balance
from moe.layer import MoELayer, aux_loss, moe_layers, update_router_biases
from moe.convert import (
    ConversionError,
    check_moe_settings,
    save_moe_settings,
    swap_ffn,
    swap_ffn_from_settings,
)
from moe.interop import from_hf, load_hf_checkpoint, save_hf_checkpoint, to_hf
from moe import checkpoint, memory, parallel  # after the layer: they build on it
from moe.recompute_frame import recompute_context
from moe.trace.replay import Routes, record_routing, replay_routing
from moe.trace.routing_trace import RoutingTrace, read_trace

__all__ = [
    "ConversionError",
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "aux_loss",
    "check_moe_settings",
    "checkpoint",
    "comm",
    "dispatch",
    "from_hf",
    "gating",
    "kernels",
    "load_hf_checkpoint",
    "memory",
    "moe_layers",
    "parallel",
    "read_trace",
    "recompute_context",
    "record_routing",
    "replay_routing",
    "reset_global_balance",
    "Routes",
    "RoutingTrace",
    "save_hf_checkpoint",
    "save_moe_settings",
    "swap_ffn",
    "swap_ffn_from_settings",
    "to_hf",
    "update_router_biases",
]
__version__ = "0.1.0"

# Feature packages load on first use (`moe.fp8`, or `from moe.fp8 import ...`, which also
# registers their formats and kernels): a model that does not use them never loads them.
_FEATURES = ("fp8", "lora")


def __getattr__(name: str):
    if name in _FEATURES:
        return importlib.import_module(f"moe.{name}")
    raise AttributeError(f"module 'moe' has no attribute {name!r}")
