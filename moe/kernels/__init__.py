"""Expert compute: registered kernels (moe/kernels/registry.py): "torch" (CPU and fallback),
"triton" and "triton_cutlass" (Triton grouped-GEMM kernels, CUDA)."""

import importlib

from moe.kernels.activations import ACTIVATIONS, apply_activation
from moe.kernels.combine import combine
from moe.kernels.expert_mlp import BACKENDS, expert_mlp, resolve_backend
from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.kernel_config import KernelConfig, kernel_config, set_kernel_config
from moe.kernels.registry import ExpertKernel, get_kernel, register_kernel, resolve_kernel
from moe.kernels.torch_grouped_mm import grouped_mm_torch
from moe.kernels.torch_kernel import TorchKernel
from moe.kernels.triton_kernel import TritonKernel
from moe.kernels.weight_format import WeightFormat, register_weight_format

# Triton entry points load on first use: importing moe never imports triton or builds kernels.
_LAZY = {
    "combine_triton": "moe.kernels.triton.combine",
    "expert_mlp_triton": "moe.kernels.triton.expert_mlp",
    "tile_schedule": "moe.kernels.triton.schedule",
}

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "ExpertKernel",
    "ExpertWeights",
    "KernelConfig",
    "TorchKernel",
    "TritonKernel",
    "WeightFormat",
    "apply_activation",
    "combine",
    "combine_triton",
    "expert_mlp",
    "expert_mlp_triton",
    "get_kernel",
    "grouped_mm_torch",
    "kernel_config",
    "register_kernel",
    "register_weight_format",
    "resolve_backend",
    "resolve_kernel",
    "set_kernel_config",
    "tile_schedule",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
