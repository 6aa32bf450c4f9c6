"""The whole expert MLP with every GEMM in FP8 (FP8Config.recipe "rowwise" or "blockwise"): up,
gate, down and their input- and weight-gradient GEMMs are moe::fp8_grouped_mm calls
(moe/fp8/grouped_mm.py).

Same contract as moe.kernels.torch_expert_mlp.expert_mlp_torch (see moe/kernels/expert_mlp.py):
x_ND is the R rows or, with rows.gather_ids_R, the token rows; offsets_L int32 cumulative row
ends; rows past offsets_L[-1] come out zero; rows.row_weights_R scale each row's activation
(and its b2) and get a gradient; rows.sum_to_tokens returns y_TD, each row added into the token
it was read from. Returns x's dtype; the weights (masters) stay in their dtype and get
gradients in it. Experts without rows get zero weight gradients.

What the backward keeps (with FP8Config.save_fp8_inputs): the gathered rows x_RD as e4m3 plus a
row scale (R * (D + 4) bytes instead of R * D * 2 or 4; blockwise: 4 bytes per 128 elements),
the activation as e4m3 plus its scales (R * (F + 4) bytes), and, for the activation's own backward, its pre-activations h_RF (and
g_RF for swiglu) in x's dtype, as autograd keeps them. It is a composition of custom ops and
plain differentiable torch ops (gather, bias, activation, combine weight, index_add), so
autograd and torch.compile see each piece; the combine into tokens uses index_add (on CUDA an
atomic add: not bit-deterministic there).
"""

import torch
from torch import Tensor

from moe.fp8.config import FP8Config
from moe.fp8.grouped_mm import fp8_grouped_mm
from moe.fp8.quant import group_of_rows
from moe.kernels.activations import GATED, apply_activation, check_activation
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows

EXPERTS_FP8 = FP8Config(experts=True)


def _row_bias(b_LX: Tensor, group_R: Tensor) -> Tensor:
    """Each row's expert bias; rows past the last offset (group L) get zero."""
    padded = torch.cat([b_LX, b_LX.new_zeros(1, b_LX.shape[1])])
    return padded.index_select(0, group_R)


def check_fp8_experts(x_ND: Tensor, w1_LDF: Tensor, config: FP8Config, activation: str) -> None:
    """One clear error before any work for what the FP8 experts cannot take."""
    check_activation(activation)
    allowed = (torch.float32, torch.bfloat16, torch.float16)
    for name, t in (("x", x_ND), ("w1", w1_LDF)):
        if t.dtype not in allowed:
            raise ValueError(f"FP8 experts: {name} has dtype {t.dtype}; they take {allowed}")


def fp8_expert_mlp(
    x_ND: Tensor,
    offsets_L: Tensor,
    w1_LDF: Tensor,
    w2_LFD: Tensor,
    w3_LDF: Tensor | None = None,
    b1_LF: Tensor | None = None,
    b2_LD: Tensor | None = None,
    *,
    activation: str = "gelu",
    rows: ExpertRows = NO_ROWS_INFO,
    config: FP8Config = EXPERTS_FP8,
) -> Tensor:
    """out_RD[r] = row_weights_R[r] * MLP_e(x[gather_ids_R[r]]) with every GEMM in FP8 (tail
    rows zero), or y_TD with rows.sum_to_tokens; see the module docstring."""
    check_fp8_experts(x_ND, w1_LDF, config, activation)
    gated = activation in GATED
    if gated and w3_LDF is None:
        raise ValueError(f"activation={activation!r} needs w3")
    offsets_L = offsets_L.to(torch.int32)
    gemm = dict(
        pow2=config.pow2_gemm_scales,
        floor=config.amax_floor,
        save_fp8=config.save_fp8_inputs,
        recipe=config.recipe,
    )
    ids_R = rows.gather_ids_R
    x_RD = x_ND if ids_R is None else x_ND.index_select(0, ids_R)
    R = x_RD.shape[0]
    group_R = group_of_rows(offsets_L, R).long()
    h_RF = fp8_grouped_mm(x_RD, w1_LDF, offsets_L, **gemm)
    if b1_LF is not None:
        h_RF = h_RF + _row_bias(b1_LF, group_R).to(h_RF.dtype)
    g_RF = fp8_grouped_mm(x_RD, w3_LDF, offsets_L, **gemm) if gated else None
    a_RF = apply_activation(h_RF, activation, g_RF)
    w_R1 = None
    if rows.row_weights_R is not None:
        w_R1 = rows.row_weights_R.to(a_RF.dtype).unsqueeze(1)
        a_RF = a_RF * w_R1
    y_RD = fp8_grouped_mm(a_RF, w2_LFD, offsets_L, **gemm)
    if b2_LD is not None:
        b_RD = _row_bias(b2_LD, group_R).to(y_RD.dtype)
        y_RD = y_RD + (b_RD if w_R1 is None else b_RD * w_R1)
    if not rows.sum_to_tokens:
        return y_RD.to(x_ND.dtype)
    ids = ids_R if ids_R is not None else torch.arange(R, device=x_ND.device)
    y_ND = y_RD.new_zeros(x_ND.shape[0], y_RD.shape[1]).index_add(0, ids, y_RD)
    return y_ND.to(x_ND.dtype)
