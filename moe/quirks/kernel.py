"""QuirkKernel: the expert MLP as a transformers family computes it, a kernel wrapper around
whichever kernel the layer resolved (claimed by MoEConfig.quirks; moe.kernels.registry applies
it after the base kernel is chosen).

    h = x W1 + b1 (gate columns),  u = x W3 + b3 (up columns)    the base kernel's projections
    a = family._apply_gate([h | u] in the family's column order)  or family.act_fn(h) (no gate)
    y = a W2 + b2,  y = family.post_expert_norm(y) (if declared),  y * row weight

The family's own function (moe.quirks.format.QuirkWeights.family: the experts module without
its weights) runs between the GEMMs, so clamped or soft-capped SwiGLUs, (up + 1) gates and
squared ReLU are the family's code, not a copy; autograd gives every gradient. Same contract as
the kernels (moe/kernels/expert_mlp.py): gather ids, row weights, sum_to_tokens, rows past
offsets_L[-1] exactly zero. A base kernel that declares no GroupedGemms is refused. The
projections are the base's (GroupedGemms.project): around moe.lora's kernel (registered first,
so it is the inner one) each carries its adapters, on the FP8 kernel its GEMMs are e4m3.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

import moe.lora  # noqa: F401  (LoRA's wrapper registered first: QuirkKernel composes around it)
from moe.kernels.expert_rows import ExpertRows
from moe.kernels.registry import ExpertKernel, GroupedGemms, KernelWrapper, register_kernel_wrapper
from moe.quirks.format import QuirkWeights


@dataclass(frozen=True)
class QuirkKernel(ExpertKernel):
    """`base` (the kernel the layer resolved) computing the family's MLP; its name and what it
    takes (devices, dtypes, formats, combine, row weights) are the base's."""

    base: ExpertKernel | None = None

    @classmethod
    def around(cls, base: ExpertKernel) -> "QuirkKernel":
        return cls(
            base.name, base.devices, base.dtypes, base.formats, base.fuses_combine,
            base.takes_row_weights, base=base,
        )  # fmt: skip

    def refuse(self, x: Tensor, weights) -> str | None:
        if not isinstance(self.base, GroupedGemms):
            return (
                "MoEConfig.quirks runs the family's function between the kernel's grouped GEMMs "
                "and this kernel declares none (moe.kernels.registry.GroupedGemms)"
            )
        if not isinstance(weights, QuirkWeights):
            return f"MoEConfig.quirks needs QuirkWeights, got {type(weights).__name__}"
        return self.base.refuse(x, weights)

    def mlp(self, x_ND, offsets_L, weights, *, activation, rows):
        return family_mlp(self.base, x_ND, offsets_L, weights, rows=rows)

    def combine(self, out_MD, pair_rows_TK, weights_TK):
        return self.base.combine(out_MD, pair_rows_TK, weights_TK)


@dataclass(frozen=True)
class QuirkWrapper(KernelWrapper):
    """Claimed by a layer with MoEConfig.quirks set: its kernel becomes QuirkKernel(kernel)."""

    selected_by = "MoEConfig.quirks"

    def claims(self, config) -> "QuirkWrapper | None":
        return self if config.quirks is not None else None

    def wrap(self, kernel: ExpertKernel) -> QuirkKernel:
        return QuirkKernel.around(kernel)


QUIRK_WRAPPER = register_kernel_wrapper(QuirkWrapper("quirks"))


def family_mlp(
    kernel: GroupedGemms, x_ND: Tensor, offsets_L: Tensor, w: QuirkWeights, *, rows: ExpertRows
) -> Tensor:
    """out_RD[r] = row_weights_R[r] * MLP_e(x[gather_ids_R[r]]) in the family's computation
    (module docstring), tail rows zero; or y_TD with rows.sum_to_tokens."""
    offs = offsets_L.to(torch.int32)
    ids_R = rows.gather_ids_R
    x_RD = x_ND if ids_R is None else x_ND.index_select(0, ids_R)
    R = x_RD.shape[0]
    expert_R = torch.searchsorted(
        offs, torch.arange(R, device=offs.device, dtype=offs.dtype), right=True
    )

    def plus_bias(y_RX: Tensor, b_LX: Tensor | None) -> Tensor:
        if b_LX is None:
            return y_RX
        padded = torch.cat([b_LX, b_LX.new_zeros(1, b_LX.shape[1])])  # tail rows: zero
        return y_RX + padded.index_select(0, expert_R).to(y_RX.dtype)

    family = w.family
    h_RF = plus_bias(kernel.project(x_RD, "w1", w, offs), w.b1_LF)
    if w.w3_LDF is None:
        a_RF = family.act_fn(h_RF)
    else:
        u_RF = plus_bias(kernel.project(x_RD, "w3", w, offs), w.b3_LF)
        if w.quirks.interleaved:  # g0 u0 g1 u1 ...
            gate_up_RN = torch.stack([h_RF, u_RF], -1).flatten(-2)
        else:
            gate_up_RN = torch.cat([h_RF, u_RF], -1)
        a_RF = family._apply_gate(gate_up_RN)
    y_RD = plus_bias(kernel.project(a_RF.to(w.w2_LFD.dtype), "w2", w, offs), w.b2_LD)
    if w.quirks.post_norm:  # (the GEMM zeroed the tail rows; a norm need not keep them 0)
        y_RD = family.post_expert_norm(y_RD)
        if not rows.all_rows_kept:
            y_RD = torch.where((expert_R < w.num_experts).unsqueeze(1), y_RD, 0)
    if rows.row_weights_R is not None:
        y_RD = y_RD * rows.row_weights_R.to(y_RD.dtype).unsqueeze(1)
    y_RD = y_RD.to(x_ND.dtype)
    if not rows.sum_to_tokens:
        return y_RD
    ids = ids_R if ids_R is not None else torch.arange(R, device=x_ND.device)
    return y_RD.new_zeros(x_ND.shape[0], y_RD.shape[1]).index_add(0, ids, y_RD)
