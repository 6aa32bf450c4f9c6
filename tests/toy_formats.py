"""Toy formats registered from outside moe/ (issue 46): a weight format (bfloat16 weights times a
per-expert scale, dequantized for the kernel) and a row format (int8 rows plus a per-row float32
scale). Importing this module registers them; tests/test_formats.py checks them against float64
references, tests/test_faults.py uses their names as MoEConfig alternatives."""

from dataclasses import dataclass

import torch
from torch import nn

from moe.dispatch.wire import RowFormat, register_row_format
from moe.kernels import ExpertWeights
from moe.kernels.weight_format import WeightFormat, register_weight_format
from moe.shards import local

MATS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class ScaledBF16(WeightFormat):
    """Weights stored as bfloat16 values times a per-expert scale kept in the layer's dtype
    (parameter `<w>_scale` [E], so EP shards it with the weights), dequantized for the kernel."""

    def setup(self, experts: nn.Module) -> None:
        for name in MATS:
            w = getattr(experts, name)
            if w is None:
                continue
            scale = w.detach().abs().amax(dim=(1, 2)).clamp_min(1e-30)
            stored = (w.detach() / scale[:, None, None]).to(torch.bfloat16)
            setattr(experts, name, nn.Parameter(stored))
            setattr(experts, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def weights(self, experts: nn.Module) -> ExpertWeights:
        def dequant(name):
            w = getattr(experts, name)
            if w is None:
                return None
            scale = local(getattr(experts, f"{name}_scale"))
            return local(w).to(scale.dtype) * scale[:, None, None]

        return ExpertWeights(dequant("w1"), dequant("w2"), dequant("w3"))


@dataclass(frozen=True)
class Int8Rows(RowFormat):
    """Rows as int8 values plus one float32 scale per row, packed in one uint8 row."""

    def encode(self, x_ND):
        scale_N = (x_ND.abs().amax(1).float() / 127).clamp_min(1e-30)
        q_ND = torch.round(x_ND / scale_N[:, None]).to(torch.int8)
        return torch.cat([q_ND.view(torch.uint8), scale_N[:, None].view(torch.uint8)], 1)

    def decode(self, payload_NP, D, dtype):
        q_ND = payload_NP[:, :D].clone().view(torch.int8)
        scale_N1 = payload_NP.new_empty(len(payload_NP), 4).copy_(payload_NP[:, D:])
        scale_N1 = scale_N1.view(torch.float32)
        return q_ND.to(dtype) * scale_N1.to(dtype)

    def row_bytes(self, D, element_size):
        return D + 4


SCALED = register_weight_format(ScaledBF16("test_scaled_bf16"))
INT8 = register_row_format(Int8Rows("test_int8_rows"))
