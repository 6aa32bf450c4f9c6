"""LoRAKernel: the expert MLP with low-rank adapters, a kernel wrapper around whichever kernel a
LoRA layer resolved (claimed by MoEConfig.lora; moe.kernels.registry applies it after the base
kernel is chosen).

Each projection W of the MLP becomes x @ W + scale * dropout(x) @ A @ B (PEFT's LoRA), A [L, in,
r], B [L, r, out] per local expert (LoRAWeights, moe/lora/format.py), computed as ragged grouped
GEMMs on the same expert-sorted rows and offsets as the base GEMM: no per-expert loop, no host
sync (beyond what the kernel's own grouped GEMM does). The base GEMMs are the base kernel's
(`GroupedGemms.weight_mm`: e4m3 for the FP8 kernel, Triton for the Triton kernels), the adapter
GEMMs its plain ones (`plain_mm`, in the adapters' dtype), composed with autograd: the frozen
base weights get no gradient (autograd skips what needs none), the adapters and x do. A base
kernel that declares no GroupedGemms (e.g. one registered with `mlp` alone) is refused: one
ValueError naming it, before any work.

Same contract as the kernels (moe/kernels/expert_mlp.py): gather ids, row weights (they scale
the activation, and b2, before the down projection: the adapter of w2 sees the scaled rows, as
the fused kernels' down GEMM does), sum_to_tokens, and rows past offsets_L[-1] exactly zero.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.kernels.activations import GATED, apply_activation
from moe.kernels.expert_rows import ExpertRows
from moe.kernels.registry import (
    ExpertKernel,
    GroupedGemms,
    KernelWrapper,
    register_kernel_wrapper,
)
from moe.lora.format import LoRAWeights


def adapter_dropout(x: Tensor, p: float) -> Tensor:
    """PEFT's lora_dropout on an adapter's input (p = 0 outside training: x itself). One
    function, so a test can swap it for a known mask."""
    return F.dropout(x, p, training=True) if p > 0 else x


@dataclass(frozen=True)
class LoRAKernel(ExpertKernel, GroupedGemms):
    """`base` (the kernel the layer resolved) with the adapters added to each projection. Its
    name and what it takes (devices, dtypes, formats, combine, row weights) are the base's.
    Its grouped GEMMs are the base's, and `project` adds the adapters: a wrapper composing its
    own MLP around this one (GroupedGemms.project) gets the adapted projections."""

    base: ExpertKernel | None = None

    @classmethod
    def around(cls, base: ExpertKernel) -> "LoRAKernel":
        return cls(
            base.name, base.devices, base.dtypes, base.formats, base.fuses_combine,
            base.takes_row_weights, base=base,
        )  # fmt: skip

    def refuse(self, x: torch.Tensor, weights) -> str | None:
        if not isinstance(self.base, GroupedGemms):
            return (
                "MoEConfig.lora runs the adapters on the kernel's grouped GEMMs and this kernel "
                "declares none (moe.kernels.registry.GroupedGemms)"
            )
        return self.base.refuse(x, weights)

    def mlp(self, x_ND, offsets_L, weights, *, activation, rows):
        if not isinstance(weights, LoRAWeights) or not weights.adapters:
            return self.base.mlp(x_ND, offsets_L, weights, activation=activation, rows=rows)
        return adapted_mlp(self.base, x_ND, offsets_L, weights, activation=activation, rows=rows)

    def combine(self, out_MD, pair_rows_TK, weights_TK):
        return self.base.combine(out_MD, pair_rows_TK, weights_TK)

    def weight_mm(self, x_MK, w_EKN, offsets_E):
        return self.base.weight_mm(x_MK, w_EKN, offsets_E)

    def plain_mm(self, x_MK, w_EKN, offsets_E):
        return self.base.plain_mm(x_MK, w_EKN, offsets_E)

    def project(self, x_MK, name, weights, offsets_E):
        if not isinstance(weights, LoRAWeights):
            return self.base.project(x_MK, name, weights, offsets_E)
        return adapted_project(self.base, x_MK, name, weights, offsets_E.to(torch.int32))


@dataclass(frozen=True)
class LoRAWrapper(KernelWrapper):
    """Claimed by a layer with MoEConfig.lora set: its kernel becomes LoRAKernel(kernel)."""

    selected_by = "MoEConfig.lora"

    def claims(self, config) -> "LoRAWrapper | None":
        return self if config.lora is not None else None

    def wrap(self, kernel: ExpertKernel) -> LoRAKernel:
        return LoRAKernel.around(kernel)


LORA_WRAPPER = register_kernel_wrapper(LoRAWrapper("lora"))


def _row_bias(b_LX: Tensor, offsets_L: Tensor, R: int) -> Tensor:
    """Each row's expert bias [R, X]; rows past the last offset get zero (no host read)."""
    rows = torch.arange(R, device=b_LX.device, dtype=offsets_L.dtype)
    group_R = torch.searchsorted(offsets_L, rows, right=True)
    padded = torch.cat([b_LX, b_LX.new_zeros(1, b_LX.shape[1])])
    return padded.index_select(0, group_R)


def adapted_project(kernel: GroupedGemms, a_RK: Tensor, name: str, w: LoRAWeights, offs: Tensor):
    """a_RK @ projection `name` of w (the kernel's weight GEMM) + scale * dropout(a) A B."""
    y_RN = kernel.project(a_RK, name, w, offs)
    A_LKr = w.adapters.get(f"A_{name}")
    if A_LKr is None:
        return y_RN
    a_in = adapter_dropout(a_RK, w.dropout)
    low_Rr = kernel.plain_mm(a_in.to(A_LKr.dtype), A_LKr, offs)
    low_RN = kernel.plain_mm(low_Rr, w.adapters[f"B_{name}"], offs)
    return y_RN + (low_RN * w.scale).to(y_RN.dtype)


def adapted_mlp(
    kernel: GroupedGemms, x_ND: Tensor, offsets_L: Tensor, weights: LoRAWeights, *,
    activation: str, rows: ExpertRows,
) -> Tensor:  # fmt: skip
    """out_RD[r] = row_weights_R[r] * MLP_e(x[gather_ids_R[r]]) with each adapted projection
    x W + scale * dropout(x) A B (tail rows zero), or y_TD with rows.sum_to_tokens."""
    w, offs = weights, offsets_L.to(torch.int32)
    ids_R = rows.gather_ids_R
    x_RD = x_ND if ids_R is None else x_ND.index_select(0, ids_R)
    R = x_RD.shape[0]

    h_RF = adapted_project(kernel, x_RD, "w1", w, offs)
    if w.b1_LF is not None:
        h_RF = h_RF + _row_bias(w.b1_LF, offs, R).to(h_RF.dtype)
    g_RF = adapted_project(kernel, x_RD, "w3", w, offs) if activation in GATED else None
    a_RF = apply_activation(h_RF, activation, g_RF)
    w_R1 = None
    if rows.row_weights_R is not None:
        w_R1 = rows.row_weights_R.to(a_RF.dtype).unsqueeze(1)
        a_RF = a_RF * w_R1
    y_RD = adapted_project(kernel, a_RF.to(w.w2_LFD.dtype), "w2", w, offs)
    if w.b2_LD is not None:
        b_RD = _row_bias(w.b2_LD, offs, R).to(y_RD.dtype)
        y_RD = y_RD + (b_RD if w_R1 is None else b_RD * w_R1.to(y_RD.dtype))
    y_RD = y_RD.to(x_ND.dtype)
    if not rows.sum_to_tokens:
        return y_RD
    ids = ids_R if ids_R is not None else torch.arange(R, device=x_ND.device)
    return y_RD.new_zeros(x_ND.shape[0], y_RD.shape[1]).index_add(0, ids, y_RD)
