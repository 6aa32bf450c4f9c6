"""The expert MLP with low-rank adapters (moe.lora): one function every kernel runs when its
ExpertWeights carry adapters (ExpertKernel.__call__ is the one place that decides).

Each projection W of the MLP becomes x @ W + scale * dropout(x) @ A @ B (PEFT's LoRA), A [L, in,
r], B [L, r, out] per local expert, computed as ragged grouped GEMMs on the same expert-sorted
rows and offsets as the base GEMM: no per-expert loop, no host sync (beyond what the kernel's
own grouped GEMM does). The base GEMMs are the kernel's (`ExpertKernel.grouped_mm`: FP8 for the
FP8 kernel, Triton for the Triton kernels), the adapter GEMMs its plain ones
(`ExpertKernel.adapter_mm`, in the adapters' dtype), composed with autograd: the frozen base
weights get no gradient (autograd skips what needs none), the adapters and x do.

Same contract as the kernels (moe/kernels/expert_mlp.py): gather ids, row weights (they scale
the activation, and b2, before the down projection: the adapter of w2 sees the scaled rows, as
the fused kernels' down GEMM does), sum_to_tokens, and rows past offsets_L[-1] exactly zero.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.kernels.activations import GATED, apply_activation
from moe.kernels.expert_rows import ExpertRows
from moe.kernels.expert_weights import ExpertWeights


def adapter_dropout(x: Tensor, p: float) -> Tensor:
    """PEFT's lora_dropout on an adapter's input (p = 0 outside training: x itself). One
    function, so a test can swap it for a known mask."""
    return F.dropout(x, p, training=True) if p > 0 else x


def _row_bias(b_LX: Tensor, offsets_L: Tensor, R: int) -> Tensor:
    """Each row's expert bias [R, X]; rows past the last offset get zero (no host read)."""
    rows = torch.arange(R, device=b_LX.device, dtype=offsets_L.dtype)
    group_R = torch.searchsorted(offsets_L, rows, right=True)
    padded = torch.cat([b_LX, b_LX.new_zeros(1, b_LX.shape[1])])
    return padded.index_select(0, group_R)


def adapted_mlp(
    kernel, x_ND: Tensor, offsets_L: Tensor, weights: ExpertWeights, *, activation: str,
    rows: ExpertRows,
) -> Tensor:  # fmt: skip
    """out_RD[r] = row_weights_R[r] * MLP_e(x[gather_ids_R[r]]) with each adapted projection
    x W + scale * dropout(x) A B (tail rows zero), or y_TD with rows.sum_to_tokens."""
    w, offs = weights, offsets_L.to(torch.int32)
    ids_R = rows.gather_ids_R
    x_RD = x_ND if ids_R is None else x_ND.index_select(0, ids_R)
    R = x_RD.shape[0]

    def project(a_RK: Tensor, name: str, w_LKN: Tensor) -> Tensor:
        y_RN = kernel.grouped_mm(a_RK, w_LKN, offs)
        A_LKr = w.adapters.get(f"A_{name}")
        if A_LKr is None:
            return y_RN
        a_in = adapter_dropout(a_RK, w.adapter_dropout)
        low_Rr = kernel.adapter_mm(a_in.to(A_LKr.dtype), A_LKr, offs)
        low_RN = kernel.adapter_mm(low_Rr, w.adapters[f"B_{name}"], offs)
        return y_RN + (low_RN * w.adapter_scale).to(y_RN.dtype)

    h_RF = project(x_RD, "w1", w.w1_LDF)
    if w.b1_LF is not None:
        h_RF = h_RF + _row_bias(w.b1_LF, offs, R).to(h_RF.dtype)
    g_RF = project(x_RD, "w3", w.w3_LDF) if activation in GATED else None
    a_RF = apply_activation(h_RF, activation, g_RF)
    w_R1 = None
    if rows.row_weights_R is not None:
        w_R1 = rows.row_weights_R.to(a_RF.dtype).unsqueeze(1)
        a_RF = a_RF * w_R1
    y_RD = project(a_RF.to(w.w2_LFD.dtype), "w2", w.w2_LFD)
    if w.b2_LD is not None:
        b_RD = _row_bias(w.b2_LD, offs, R).to(y_RD.dtype)
        y_RD = y_RD + (b_RD if w_R1 is None else b_RD * w_R1.to(y_RD.dtype))
    y_RD = y_RD.to(x_ND.dtype)
    if not rows.sum_to_tokens:
        return y_RD
    ids = ids_R if ids_R is not None else torch.arange(R, device=x_ND.device)
    return y_RD.new_zeros(x_ND.shape[0], y_RD.shape[1]).index_add(0, ids, y_RD)
