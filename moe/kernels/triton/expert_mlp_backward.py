"""Backward of the Triton expert MLP (`moe::triton_expert_mlp`, expert_mlp.py) as three custom
ops, run by expert_mlp._backward in this order so each buffer dies after its last reader:

  act step    (dout, pre) -> dpre, a = s * act(pre) (for dW2), d_row_weights   -> pre released
  input step  (dpre, x)   -> dx, dW1, dW3, db1                                 -> dpre released
  w2 step     (a, dout)   -> dW2, db2   (the last weight gradient: only a and dout alive)

Each GEMM runs on the Triton kernel or, for the roles moe/kernels/gemm_roles.py sends there, on
CUTLASS (cutlass_roles.py). No host sync, no float atomics.
"""

import torch
from torch import Tensor

from moe.kernels.activations import GATED
from moe.kernels.torch_grouped_mm import zero_tail_rows
from moe.kernels.triton import cutlass_roles as cutlass_mm
from moe.kernels.triton.activations import act_code, pre_width
from moe.kernels.triton.common import check_device
from moe.kernels.triton.gather_sum import rows_to_tokens
from moe.kernels.triton.grouped_mm import EPI_ACT_BWD, ragged_mm
from moe.kernels.triton.grouped_mm_wgrad import busiest_first, ragged_reduce_mm


@torch.library.custom_op("moe::triton_expert_mlp_backward_act", mutates_args=())
def backward_act(
    d_out_RD: Tensor,
    offsets_L: Tensor,
    w2_LFD: Tensor,
    b2_LD: Tensor | None,
    pre: Tensor,
    row_weights_R: Tensor | None,
    activation: str,
    need_w: bool,
    cutlass: str = "",
) -> tuple[Tensor, Tensor, Tensor]:
    """(dpre, a_RF, d_row_weights): the steps that read the pre-activation. a_RF = s * act(pre)
    (what GEMM2 read, for dW2 in the last step; empty unless need_w) is half of pre, so
    keeping it instead of pre until dW2 lowers the peak; the activation backward writes it
    from the pre tiles it loads (no recompute pass). d_row_weights is empty unless row
    weights are given."""
    check_device(d_out_RD, offsets_L, w2_LFD, b2_LD, pre, row_weights_R)
    gated = activation in GATED
    L, F, D = w2_LFD.shape
    R = d_out_RD.shape[0]
    empty = lambda: d_out_RD.new_empty(0)  # a fresh one per output: outputs must not alias
    scaled = row_weights_R is not None
    a_RF = pre.new_empty(R, F) if need_w else empty()
    act_out = a_RF if need_w and R > 0 and F > 0 else None
    if cutlass_mm.on(cutlass, "dact") and cutlass_mm.fits(d_out_RD, w2_LFD.transpose(1, 2)):
        dpre, d_rw = cutlass_mm.dact(
            d_out_RD, w2_LFD, offsets_L, pre, row_weights_R, activation, act_out
        )
    else:
        dpre = pre.new_empty(R, pre_width(F, activation))
        rowdot = None
        if scaled:  # every entry written (tail tiles included): no zero fill
            rowdot = torch.empty((F + 15) // 16, R, device=pre.device, dtype=torch.float32)
        ragged_mm(
            d_out_RD, w2_LFD.transpose(1, 2), offsets_L, dpre, epilogue=EPI_ACT_BWD,
            act=act_code(activation), pre=pre, gated=gated, row_scale_M=row_weights_R,
            rowdot_NM=rowdot, act_out=act_out,
        )  # fmt: skip
        d_rw = rowdot.sum(0) if scaled else None
    if scaled and b2_LD is not None:  # ds[m] += <dout[m], b2[e]>: an N = 1 grouped GEMM
        dot_R1 = d_out_RD.new_empty(R, 1)
        ragged_mm(d_out_RD, b2_LD.unsqueeze(2), offsets_L, dot_R1)
        d_rw += dot_R1.squeeze(1).float()
    return dpre, a_RF, d_rw.to(row_weights_R.dtype) if scaled else empty()


@backward_act.register_fake
def _backward_act_fake(d_out_RD, offsets_L, w2_LFD, b2_LD, pre, row_weights_R, activation, need_w,
                  cutlass=""):  # fmt: skip
    L, F, D = w2_LFD.shape
    empty = lambda: d_out_RD.new_empty(0)
    a_RF = pre.new_empty(pre.shape[0], F) if need_w else empty()
    d_rw = row_weights_R.new_empty(pre.shape[0]) if row_weights_R is not None else empty()
    return pre.new_empty(pre.shape[0], pre_width(F, activation)), a_RF, d_rw


@torch.library.custom_op("moe::triton_expert_mlp_backward_w2", mutates_args=())
def backward_w2(
    a_RF: Tensor,
    d_out_RD: Tensor,
    offsets_L: Tensor,
    row_weights_R: Tensor | None,
    order_E: Tensor | None,
    need_b2: bool,
    cutlass: str = "",
) -> tuple[Tensor, Tensor]:
    """(dW2, db2): the last step, after dpre is released (db2 empty unless asked for). order_E:
    the experts busiest first (busiest_first), shared with the input step; None: made here."""
    check_device(a_RF, d_out_RD, offsets_L, row_weights_R, order_E)
    L, F, D = offsets_L.shape[0], a_RF.shape[1], d_out_RD.shape[1]
    scaled = row_weights_R is not None
    db2 = d_out_RD.new_empty(0)
    db2_f = None
    if need_b2 and not scaled:
        db2_f = torch.empty(L, D, device=a_RF.device, dtype=torch.float32)
    R = a_RF.shape[0]
    if (
        cutlass_mm.on(cutlass, "wgrad2")
        and db2_f is None
        and cutlass_mm.wgrad_fits(R, a_RF, d_out_RD)
    ):
        dw2 = cutlass_mm.wgrad2(a_RF, d_out_RD, offsets_L)
    else:
        dw2 = a_RF.new_empty(L, F, D)
        ragged_reduce_mm(a_RF, d_out_RD, offsets_L, dw2, dbias_EJ=db2_f, order_E=order_E)
    if need_b2 and scaled:  # db2[e] = sum of s[m] * dout[m]: a K = 1 ragged reduction
        db2_L1D = a_RF.new_empty(L, 1, D)
        s_R1 = row_weights_R.to(d_out_RD.dtype).unsqueeze(1)
        ragged_reduce_mm(s_R1, d_out_RD, offsets_L, db2_L1D, order_E=order_E)
        db2 = db2_L1D.view(L, D)
    elif need_b2:
        db2 = db2_f.to(d_out_RD.dtype)
    return dw2, db2


@backward_w2.register_fake
def _backward_w2_fake(a_RF, d_out_RD, offsets_L, row_weights_R, order_E, need_b2, cutlass=""):
    L, F, D = offsets_L.shape[0], a_RF.shape[1], d_out_RD.shape[1]
    db2 = d_out_RD.new_empty(L, D) if need_b2 else d_out_RD.new_empty(0)
    return a_RF.new_empty(L, F, D), db2


@torch.library.custom_op("moe::triton_expert_mlp_backward_input", mutates_args=())
def backward_input(
    dpre: Tensor,
    x_ND: Tensor,
    offsets_L: Tensor,
    w1_LDF: Tensor,
    w3_LDF: Tensor | None,
    gather_ids_R: Tensor | None,
    token_rows_TK: Tensor | None,
    order_E: Tensor | None,
    activation: str,
    need_x: bool,
    need_w: bool,
    need_b1: bool,
    cutlass: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw1, dw3, db1) from dpre = [dh | dg]; the ones not asked for are empty. dx rows are
    summed into tokens through token_rows_TK (each token's rows, ascending) when given; order_E
    as for backward_w2."""
    check_device(dpre, x_ND, offsets_L, w1_LDF, w3_LDF, gather_ids_R, token_rows_TK, order_E)
    gated = activation in GATED
    L, D, F = w1_LDF.shape
    R = dpre.shape[0]
    empty = lambda: x_ND.new_empty(0)
    dx = empty()
    if need_x:  # first: the weight gradients are not alive yet while dx_RD is
        if cutlass_mm.on(cutlass, "dx") and cutlass_mm.dx_fits(dpre, w1_LDF, w3_LDF, gated):
            dx_RD = cutlass_mm.dx(dpre, w1_LDF, w3_LDF if gated else None, offsets_L)
            if gather_ids_R is None:
                zero_tail_rows(dx_RD, offsets_L)  # returned as is: tail rows zero
        else:
            dx_RD = x_ND.new_empty(R, D)
            w3_t = w3_LDF.transpose(1, 2) if gated else None
            ragged_mm(dpre, w1_LDF.transpose(1, 2), offsets_L, dx_RD, b2_EKN=w3_t, gated=gated)
        if gather_ids_R is None:
            dx = dx_RD
        else:
            T = x_ND.shape[0]
            dx = rows_to_tokens(dx_RD, gather_ids_R, offsets_L[-1], T, token_rows_TK)
        del dx_RD
    dw1, dw3, db1 = empty(), empty(), empty()
    parts = cutlass_mm.halves(dpre, F, gated)
    if (
        need_w
        and cutlass_mm.on(cutlass, "wgrad13")
        and not need_b1
        and cutlass_mm.wgrad_fits(R, x_ND, *parts)
    ):
        dw1, dw3 = cutlass_mm.wgrad13(x_ND, dpre, offsets_L, gather_ids_R, F, gated)
        dw3 = dw3 if gated else empty()
    elif need_w:
        db1_f = torch.empty(L, F, device=x_ND.device, dtype=torch.float32) if need_b1 else None
        order = busiest_first(offsets_L) if order_E is None else order_E
        dw1 = w1_LDF.new_empty(L, D, F)
        dw3 = w1_LDF.new_empty(L, D, F) if gated else dw3  # one launch: dpre = [dh | dg]
        ragged_reduce_mm(
            x_ND, dpre if gated else dpre[:, :F], offsets_L, dw1, idx_M=gather_ids_R,
            dbias_EJ=db1_f, order_E=order, out2_EIJ=dw3 if gated else None,
        )  # fmt: skip
        db1 = db1_f.to(x_ND.dtype) if need_b1 else db1
    return dx, dw1, dw3, db1


@backward_input.register_fake
def _backward_input_fake(dpre, x_ND, offsets_L, w1_LDF, w3_LDF, gather_ids_R, token_rows_TK,
                         order_E, activation, need_x, need_w, need_b1, cutlass=""):  # fmt: skip
    L, D, F = w1_LDF.shape
    empty = lambda: x_ND.new_empty(0)
    dx = x_ND.new_empty(x_ND.shape) if need_x else empty()
    if not need_w:
        return dx, empty(), empty(), empty()
    dw3 = x_ND.new_empty(L, D, F) if activation in GATED else empty()
    db1 = x_ND.new_empty(L, F) if need_b1 else empty()
    return dx, x_ND.new_empty(L, D, F), dw3, db1
