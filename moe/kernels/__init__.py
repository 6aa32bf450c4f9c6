"""Expert compute: the torch backend (CPU and fallback) and Triton grouped-GEMM kernels (CUDA)."""

from moe.kernels.activations import ACTIVATIONS, apply_activation
from moe.kernels.combine import combine
from moe.kernels.expert_mlp import BACKENDS, expert_mlp, resolve_backend
from moe.kernels.torch_grouped_mm import grouped_mm_torch

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "apply_activation",
    "combine",
    "expert_mlp",
    "grouped_mm_torch",
    "resolve_backend",
]
