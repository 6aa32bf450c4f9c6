"""The "torch" expert kernel: moe::expert_mlp (moe/kernels/torch_expert_mlp.py) on any device
and every float dtype, with the torch combine op and grouped GEMMs (GroupedGemms: for a kernel
wrapper). backend="auto" falls back to it."""

from dataclasses import dataclass

import torch

from moe.kernels.registry import ExpertKernel, GroupedGemms, register_kernel
from moe.kernels.torch_expert_mlp import expert_mlp_torch


@dataclass(frozen=True)
class TorchKernel(ExpertKernel, GroupedGemms):
    def mlp(self, x_ND, offsets_L, weights, *, activation, rows):
        w = weights
        return expert_mlp_torch(
            x_ND, offsets_L, w.w1_LDF, w.w2_LFD, w.w3_LDF, w.b1_LF, w.b2_LD,
            activation=activation, rows=rows,
        )  # fmt: skip

    def auto_on(self, device: torch.device) -> bool:
        return True


TORCH = register_kernel(TorchKernel("torch"))
