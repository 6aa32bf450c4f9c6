"""Expert compute: the torch backend (CPU and fallback) and Triton grouped-GEMM kernels (CUDA)."""

import importlib

from moe.kernels.activations import ACTIVATIONS, apply_activation
from moe.kernels.combine import combine
from moe.kernels.expert_mlp import BACKENDS, expert_mlp, resolve_backend
from moe.kernels.kernel_config import KernelConfig, kernel_config, set_kernel_config
from moe.kernels.torch_grouped_mm import grouped_mm_torch

# Triton entry points load on first use: importing moe never imports triton or builds kernels.
_LAZY = {
    "combine_triton": "moe.kernels.triton.combine",
    "expert_mlp_triton": "moe.kernels.triton.expert_mlp",
    "tile_schedule": "moe.kernels.triton.schedule",
}

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "KernelConfig",
    "apply_activation",
    "combine",
    "combine_triton",
    "expert_mlp",
    "expert_mlp_triton",
    "grouped_mm_torch",
    "kernel_config",
    "resolve_backend",
    "set_kernel_config",
    "tile_schedule",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
