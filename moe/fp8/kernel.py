"""The "fp8" expert kernel: every expert GEMM in e4m3 (moe.fp8.fp8_expert_mlp), one registered
ExpertKernel like the torch and Triton ones. A layer with MoEConfig.fp8 = FP8Config(experts=True)
runs an instance holding its FP8Config (`kernel_for_layer`; MoEConfig takes backend "auto" or
"fp8" with it, and refuses backend="fp8" without it). The registered instance (the default
FP8Config(experts=True): rowwise, power-of-two scales) serves GroupedExperts(backend="fp8")
used on its own.

What it takes: float32, bfloat16 and float16 weights and inputs on any device (CPU: the
emulation, quantize -> dequantize -> grouped GEMM in float32; CUDA sm_90+: the rowwise GEMMs on
torch._scaled_grouped_mm, see moe/fp8/grouped_mm.py). Anything else is refused by `refuse`,
which the layer raises as one error naming itself and the kernel (never a silent bf16 run).
"""

from dataclasses import dataclass

import torch

from moe.fp8.config import FP8Config
from moe.fp8.expert_mlp import EXPERTS_FP8, fp8_expert_mlp
from moe.kernels.registry import ExpertKernel, register_kernel

FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FP8Kernel(ExpertKernel):
    """config: the FP8 settings its GEMMs use (recipe, scales, what the backward keeps)."""

    dtypes: tuple[torch.dtype, ...] | None = FP8_DTYPES
    config: FP8Config = EXPERTS_FP8

    def mlp(self, x_ND, offsets_L, weights, *, activation, rows):
        w = weights
        return fp8_expert_mlp(
            x_ND, offsets_L, w.w1_LDF, w.w2_LFD, w.w3_LDF, w.b1_LF, w.b2_LD,
            activation=activation, rows=rows, config=self.config,
        )  # fmt: skip


FP8 = register_kernel(FP8Kernel("fp8"))


def kernel_for_layer(backend: str, fp8: FP8Config | None) -> "str | ExpertKernel":
    """What a layer's GroupedExperts resolve (their `backend`): the FP8 kernel with the layer's
    FP8Config when fp8.experts (MoEConfig allows backend "auto" or "fp8" then), else backend."""
    if fp8 is None or not fp8.experts:
        return backend
    return FP8Kernel("fp8", config=fp8)
