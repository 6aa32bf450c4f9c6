"""The whole expert MLP with every GEMM in FP8 (FP8Config.recipe "rowwise" or "blockwise"): up,
gate, down and their input- and weight-gradient GEMMs are moe::fp8_grouped_mm calls
(moe/fp8/grouped_mm.py).

Same contract as moe.kernels.torch_expert_mlp.expert_mlp_torch (see moe/kernels/expert_mlp.py):
x_ND is the R rows or, with rows.gather_ids_R, the token rows; offsets_L int32 cumulative row
ends; rows past offsets_L[-1] come out zero; rows.row_weights_R scale each row's activation
(and its b2) and get a gradient; rows.sum_to_tokens returns y_TD, each row added into the token
it was read from. Returns x's dtype; the weights (masters) stay in their dtype and get
gradients in it. Experts without rows get zero weight gradients.

What the backward keeps (moe/fp8/expert_mlp_fn.py, one autograd.Function for the rows part):
x once, per token, as e4m3 plus its scales (FP8Config.save_fp8_inputs; x itself without it),
shared by the up and gate GEMMs, and the pre-activations h_RF (and g_RF for swiglu) in x's
dtype; the activation and the down GEMM's e4m3 input are recomputed from them, as the bf16
torch kernel does. The same custom ops, quantizations and derivative kernels as the chain of
moe::fp8_grouped_mm calls it replaced: the same values. The combine into tokens is an index_add
(on CUDA an atomic add: not bit-deterministic there) that keeps only the row ids.
"""

import torch
from torch import Tensor

from moe.fp8.config import FP8Config
from moe.fp8.expert_mlp_fn import _FP8MLP, SumToTokens, row_bias
from moe.fp8.grouped_mm import check_gemm
from moe.fp8.quant import group_of_rows
from moe.kernels.activations import GATED, check_activation
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows

EXPERTS_FP8 = FP8Config(experts=True)


def check_fp8_experts(x_ND: Tensor, w1_LDF: Tensor, config: FP8Config, activation: str) -> None:
    """One clear error before any work for what the FP8 experts cannot take."""
    check_activation(activation)
    allowed = (torch.float32, torch.bfloat16, torch.float16)
    for name, t in (("x", x_ND), ("w1", w1_LDF)):
        if t.dtype not in allowed:
            raise ValueError(f"FP8 experts: {name} has dtype {t.dtype}; they take {allowed}")


def _check_shapes(x_shape, offsets_L, w1_LDF, w2_LFD, w3_LDF, recipe) -> None:
    """The three GEMMs' operand checks (fp8_grouped_mm's), before any work."""
    check_gemm(x_shape, w1_LDF, offsets_L, recipe)
    if w3_LDF is not None:
        check_gemm(x_shape, w3_LDF, offsets_L, recipe)
    check_gemm((x_shape[0], w1_LDF.shape[2]), w2_LFD, offsets_L, recipe)


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
    ids_R = rows.gather_ids_R
    R = x_ND.shape[0] if ids_R is None else ids_R.shape[0]
    _check_shapes(
        (R, x_ND.shape[1]), offsets_L, w1_LDF, w2_LFD, w3_LDF if gated else None, config.recipe
    )
    w_R1 = None
    if rows.row_weights_R is not None:
        w_R1 = rows.row_weights_R.to(x_ND.dtype).unsqueeze(1)
    gemm = (
        config.pow2_gemm_scales,
        float(config.amax_floor),
        config.save_fp8_inputs,
        config.recipe,
        config.wgrad_bf16,
    )
    y_RD = _FP8MLP.apply(
        x_ND.contiguous(), ids_R, offsets_L, w1_LDF.contiguous(), w2_LFD.contiguous(),
        w3_LDF.contiguous() if gated else None, b1_LF, w_R1, activation, gemm,
    )  # fmt: skip
    if b2_LD is not None:
        group_R = group_of_rows(offsets_L, R).long()
        b_RD = row_bias(b2_LD, group_R).to(y_RD.dtype)
        y_RD = y_RD + (b_RD if w_R1 is None else b_RD * w_R1)
    if not rows.sum_to_tokens:
        return y_RD.to(x_ND.dtype)
    ids = ids_R if ids_R is not None else torch.arange(R, device=x_ND.device)
    y_ND = SumToTokens.apply(y_RD, ids, x_ND.shape[0])
    return y_ND.to(x_ND.dtype)
