"""The "fp8" expert kernel: every expert GEMM in e4m3 (moe.fp8.fp8_expert_mlp), one registered
ExpertKernel like the torch and Triton ones, chosen by one setting: a layer with
MoEConfig.fp8 = FP8Config(experts=True) runs an instance holding its FP8Config (`claims`,
asked by moe.kernels.registry.kernel_for_layer; backend stays "auto" or names "fp8", and
backend="fp8" without FP8Config(experts=True) is refused). The registered instance (the default
FP8Config(experts=True): rowwise, power-of-two scales) serves GroupedExperts(backend="fp8")
used on its own, outside a layer.

What it takes: float32, bfloat16 and float16 weights and inputs on any device (CPU: the
emulation, quantize -> dequantize -> grouped GEMM in float32; CUDA sm_90+: the rowwise GEMMs on
torch._scaled_grouped_mm, see moe/fp8/grouped_mm.py). Anything else is refused by `refuse`,
which the layer raises as one error naming itself and the kernel (never a silent bf16 run).
Its grouped GEMMs (GroupedGemms, for a kernel wrapper such as moe.lora's) are e4m3 on the
experts' weights and the operands' dtype for the wrapper's own tensors.
"""

from dataclasses import dataclass

import torch

from moe.fp8.config import FP8Config
from moe.fp8.expert_mlp import EXPERTS_FP8, fp8_expert_mlp
from moe.fp8.grouped_mm import fp8_grouped_mm
from moe.kernels.registry import ExpertKernel, GroupedGemms, register_kernel
from moe.kernels.torch_grouped_mm import grouped_mm_torch
from moe.kernels.triton_kernel import triton_installed

FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FP8Kernel(ExpertKernel, GroupedGemms):
    """config: the FP8 settings its GEMMs use (recipe, scales, what the backward keeps)."""

    dtypes: tuple[torch.dtype, ...] | None = FP8_DTYPES
    takes_row_weights: bool = False  # the rows' FP8 scales must see them as between ranks
    config: FP8Config = EXPERTS_FP8
    selected_by = "MoEConfig.fp8 = FP8Config(experts=True)"

    def claims(self, config) -> "FP8Kernel | None":
        fp8 = config.fp8
        return FP8Kernel(self.name, config=fp8) if fp8 is not None and fp8.experts else None

    def mlp(self, x_ND, offsets_L, weights, *, activation, rows):
        w = weights
        return fp8_expert_mlp(
            x_ND, offsets_L, w.w1_LDF, w.w2_LFD, w.w3_LDF, w.b1_LF, w.b2_LD,
            activation=activation, rows=rows, config=self.config,
        )  # fmt: skip

    def weight_mm(self, x_MK, w_EKN, offsets_E):
        """e4m3 with this kernel's scales and weight-gradient setting (e.g. the base GEMMs of
        moe.lora's MLP)."""
        c = self.config
        return fp8_grouped_mm(
            x_MK, w_EKN, offsets_E, pow2=c.pow2_gemm_scales, floor=c.amax_floor,
            save_fp8=c.save_fp8_inputs, recipe=c.recipe, wgrad_bf16=c.wgrad_bf16,
        )  # fmt: skip

    def combine(self, out_MD, pair_rows_TK, weights_TK):
        """On CUDA the Triton gather-sum (one pass each way, as the Triton kernel's), else
        the torch op: the rows come back weighed by the combine, not by the FP8 GEMMs."""
        if out_MD.is_cuda and triton_installed():
            from moe.kernels.triton.combine import combine_triton

            return combine_triton(out_MD, pair_rows_TK, weights_TK)
        return super().combine(out_MD, pair_rows_TK, weights_TK)

    def plain_mm(self, x_MK, w_EKN, offsets_E):
        """In the operands' dtype: Triton's GEMM on CUDA where installed, else torch's."""
        if x_MK.is_cuda and triton_installed():
            from moe.kernels.triton.ragged_mm_fn import ragged_mm_triton

            return ragged_mm_triton(x_MK, w_EKN, offsets_E)
        return grouped_mm_torch(x_MK, w_EKN, offsets_E)


FP8 = register_kernel(FP8Kernel("fp8"))
