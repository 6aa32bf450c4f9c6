"""The GEMM roles of the Triton expert MLP on CUTLASS (torch._grouped_mm), for the roles that
moe/kernels/gemm_roles.py sends there: each computes what the Triton kernel of that role
computes, with the epilogue's work as separate passes (gather, activation, its backward, the tail
rows' zeros). The Triton kernels and these read only rows below offsets_L[-1]; where a result's
tail rows are part of the contract (the rows returned, dx without a gather) they are zeroed on
the device (torch_grouped_mm.zero_tail_rows). No host sync.

A role runs here only where torch._grouped_mm runs (`fits`) and its fused epilogue holds no bias
(biases stay on the Triton kernels: no expert MLP of the benchmark shapes has one).
"""

import torch
from torch import Tensor

from moe.kernels import torch_grouped_mm
from moe.kernels.activations import GATED
from moe.kernels.torch_grouped_mm import zero_tail_rows
from moe.kernels.triton.activations import act_rows
from moe.kernels.triton.row_passes import act_bwd_rows


def on(cutlass: str, role: str) -> bool:
    """`role` is one of the comma-separated roles sent to CUTLASS."""
    return role in cutlass.split(",")


def fits(*mats: Tensor) -> bool:
    """torch._grouped_mm runs on these non-empty operands (the torch backend's rule)."""
    return all(m.numel() > 0 for m in mats) and torch_grouped_mm.fits(*mats)


def wgrad_fits(R: int, a_NK: Tensor, *b_RN: Tensor) -> bool:
    """The weight-gradient form on R > 0 rows (the torch backend's rule)."""
    return R > 0 and torch_grouped_mm.wgrad_fits(R, a_NK, *b_RN)


def _rows(x_ND: Tensor, gather_ids_R: Tensor | None) -> Tensor:
    return x_ND if gather_ids_R is None else x_ND.index_select(0, gather_ids_R)


def up(x_ND, w1_LDF, w3_LDF, offsets_L, gather_ids_R, row_weights_R, activation, save):
    """(act_RF, pre): act = s * act(x_rows @ w1 (, x_rows @ w3)); pre = [h | g] if `save`."""
    F = w1_LDF.shape[2]
    xp_RD = _rows(x_ND, gather_ids_R)
    if activation in GATED:  # h and g written into one [R, 2F] buffer, one at a time
        pre = xp_RD.new_empty(xp_RD.shape[0], 2 * F)
        pre[:, :F] = torch._grouped_mm(xp_RD, w1_LDF, offs=offsets_L)
        pre[:, F:] = torch._grouped_mm(xp_RD, w3_LDF, offs=offsets_L)
    else:
        pre = torch._grouped_mm(xp_RD, w1_LDF, offs=offsets_L)
    del xp_RD
    act_RF = act_rows(pre, F, activation, row_weights_R, offsets_L)
    if not save:
        return act_RF, pre.new_empty(pre.shape[0], 0)
    return act_RF, zero_tail_rows(pre, offsets_L)  # an op output: no unwritten rows


def up_fits(x_ND, w1_LDF, w3_LDF) -> bool:
    return fits(x_ND, w1_LDF, *(() if w3_LDF is None else (w3_LDF,)))


def down(act_RF: Tensor, w2_LFD: Tensor, offsets_L: Tensor) -> Tensor:
    """out_RD = act @ w2 per expert; tail rows unwritten (the caller zeroes them if returned)."""
    return torch._grouped_mm(act_RF, w2_LFD, offs=offsets_L)


def dact(d_out_RD, w2_LFD, offsets_L, pre, row_weights_R, activation, act_out=None):
    """(dpre, ds or None): da = dout @ w2^T, then the activation backward as one row pass
    (which also writes s * act(pre) into act_out if given)."""
    da_RF = torch._grouped_mm(d_out_RD, w2_LFD.transpose(1, 2), offs=offsets_L)
    return act_bwd_rows(da_RF, pre, activation, row_weights_R, offsets_L, act_out)


def halves(dpre: Tensor, F: int, gated: bool) -> tuple[Tensor, ...]:
    """dpre's parts: (dh, dg) for swiglu, else (dh,)."""
    return (dpre[:, :F], dpre[:, F:]) if gated else (dpre,)


def dx_fits(dpre, w1_LDF, w3_LDF, gated) -> bool:
    F = w1_LDF.shape[2]
    ws = (w1_LDF, w3_LDF) if gated else (w1_LDF,)
    return fits(*halves(dpre, F, gated), *(w.transpose(1, 2) for w in ws))


def dx(dpre: Tensor, w1_LDF: Tensor, w3_LDF: Tensor | None, offsets_L: Tensor) -> Tensor:
    """dx_RD = dh @ w1^T (+ dg @ w3^T); tail rows unwritten."""
    gated = w3_LDF is not None
    parts = halves(dpre, w1_LDF.shape[2], gated)
    dx_RD = torch._grouped_mm(parts[0], w1_LDF.transpose(1, 2), offs=offsets_L)
    if gated:
        dx_RD += torch._grouped_mm(parts[1], w3_LDF.transpose(1, 2), offs=offsets_L)
    return dx_RD


def wgrad13(x_ND, dpre, offsets_L, gather_ids_R, F, gated) -> tuple[Tensor, Tensor | None]:
    """(dW1, dW3 or None) = x_rows^T @ dh (, x_rows^T @ dg) per expert."""
    xt_DR = _rows(x_ND, gather_ids_R).t()
    dws = [torch._grouped_mm(xt_DR, part, offs=offsets_L) for part in halves(dpre, F, gated)]
    return dws[0], (dws[1] if gated else None)


def wgrad2(a_RF: Tensor, d_out_RD: Tensor, offsets_L: Tensor) -> Tensor:
    """dW2 = a^T @ dout per expert."""
    return torch._grouped_mm(a_RF.t(), d_out_RD, offs=offsets_L)
