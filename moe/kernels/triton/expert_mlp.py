"""Expert MLP on the Triton grouped GEMMs: custom ops (torch.compile-safe) with autograd.

Forward, 2 launches (+ a gather-sum with sum_to_rows): up (gather on load + b1 + fused
activation, w1 and w3 in one pass for swiglu, times the row's combine weight; stores the
pre-activation when grad is needed) and down (+ b2). Only the pre-activation [M, F] ([M, 2F] for
swiglu) is kept for backward, on ctx (not as a differentiable output: no zero gradient is ever
materialised for it), and released as soon as the activation backward has read it.
Backward, two custom ops so the pre-activation dies between them:
  act step:   a = s * act(pre) recomputed (one elementwise pass) -> dW2 = a^T @ dout, db2;
              dpre = act'(pre) * s * (dout @ w2^T), ds = <dout @ w2^T, act(pre)> per row
              (fused in the GEMM epilogue, 16-column partials summed after: no atomics)
  input step: dx = dpre @ w1^T (+ dg @ w3^T), summed to tokens through the inverse map;
              dW1 = x^T @ dh, db1 (x gathered), dW3 = x^T @ dg
No host sync, no float atomics: deterministic, CUDA-graph capturable. The semantics are those of
moe/kernels/expert_mlp.py (the contract every backend follows).
"""

import torch
from torch import Tensor

from moe.kernels.activations import GATED
from moe.kernels.triton.activations import ACT_CODES, act_rows
from moe.kernels.triton.common import check_device, out_dtype_ok
from moe.kernels.triton.gather_sum import rows_to_tokens
from moe.kernels.triton.grouped_mm import EPI_ACT, EPI_ACT_BWD, EPI_PLAIN, ragged_mm
from moe.kernels.triton.grouped_mm_wgrad import busiest_first, ragged_reduce_mm


def _act_code(activation: str) -> int:
    if activation not in ACT_CODES:
        raise ValueError(
            f"activation={activation!r} is not supported; choose one of {tuple(ACT_CODES)}"
        )
    return ACT_CODES[activation]


def _pre_width(F: int, activation: str) -> int:
    return 2 * F if activation in GATED else F


def _num_out_rows(x_TD: Tensor, token_ids_M: Tensor | None, sum_to_rows: bool) -> int:
    if sum_to_rows or token_ids_M is None:
        return x_TD.shape[0]
    return token_ids_M.shape[0]


@torch.library.custom_op("moe::triton_expert_mlp", mutates_args=())
def _fwd_op(
    x_TD: Tensor,
    offsets_E: Tensor,
    w1_EDF: Tensor,
    w2_EFD: Tensor,
    w3_EDF: Tensor | None,
    b1_EF: Tensor | None,
    b2_ED: Tensor | None,
    token_ids_M: Tensor | None,
    row_weights_M: Tensor | None,
    activation: str,
    save: bool,
    sum_to_rows: bool,
) -> tuple[Tensor, Tensor]:
    """(out, pre): out_MD[m] = s[m] * MLP(x[ids[m]]) (tail rows zero), or with sum_to_rows
    out_TD[t] = sum of the rows read from x row t; pre = h (or [h | g] for swiglu) if `save`,
    else empty."""
    check_device(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, token_ids_M, row_weights_M)
    out_dtype_ok(x_TD.dtype)
    code = _act_code(activation)
    gated = activation in GATED
    M = token_ids_M.shape[0] if token_ids_M is not None else x_TD.shape[0]
    F, D = w1_EDF.shape[2], w2_EFD.shape[2]
    act = x_TD.new_empty(M, F)
    pre = x_TD.new_empty(M, _pre_width(F, activation) if save else 0)
    ragged_mm(
        x_TD, w1_EDF, offsets_E, act, epilogue=EPI_ACT, act=code,
        b2_EKN=w3_EDF if gated else None, bias_EN=b1_EF, idx_M=token_ids_M,
        pre=pre if save else None, save_pre=save, gated=gated, row_scale_M=row_weights_M,
    )  # fmt: skip
    out = x_TD.new_empty(M, D)
    ragged_mm(act, w2_EFD, offsets_E, out, epilogue=EPI_PLAIN, bias_EN=b2_ED,
              row_scale_M=row_weights_M)  # fmt: skip
    del act
    if sum_to_rows and token_ids_M is not None:
        out = rows_to_tokens(out, token_ids_M, offsets_E[-1], x_TD.shape[0])
    return out, pre


@_fwd_op.register_fake
def _fwd_fake(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, token_ids_M, row_weights_M,
              activation, save, sum_to_rows):  # fmt: skip
    M = token_ids_M.shape[0] if token_ids_M is not None else x_TD.shape[0]
    F, D = w1_EDF.shape[2], w2_EFD.shape[2]
    pre = x_TD.new_empty(M, _pre_width(F, activation) if save else 0)
    return x_TD.new_empty(_num_out_rows(x_TD, token_ids_M, sum_to_rows), D), pre


@torch.library.custom_op("moe::triton_expert_mlp_backward_act", mutates_args=())
def _bwd_act_op(
    d_out_MD: Tensor,
    offsets_E: Tensor,
    w2_EFD: Tensor,
    b2_ED: Tensor | None,
    pre: Tensor,
    row_weights_M: Tensor | None,
    activation: str,
    need_w: bool,
    need_b2: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dpre, dw2, db2, d_row_weights): the steps that read the pre-activation; dw2, db2 are
    empty unless asked for, d_row_weights unless row weights are given."""
    check_device(d_out_MD, offsets_E, w2_EFD, b2_ED, pre, row_weights_M)
    gated = activation in GATED
    E, F, D = w2_EFD.shape
    M = d_out_MD.shape[0]
    empty = lambda: d_out_MD.new_empty(0)  # a fresh one per output: outputs must not alias
    scaled = row_weights_M is not None
    dw2 = db2 = empty()
    if need_w:
        db2_f = None
        if need_b2 and not scaled:
            db2_f = torch.empty(E, D, device=pre.device, dtype=torch.float32)
        a_MF = act_rows(pre, F, activation, row_weights_M)  # s * act: what GEMM2 read
        dw2 = w2_EFD.new_empty(E, F, D)
        ragged_reduce_mm(a_MF, d_out_MD, offsets_E, dw2, dbias_EJ=db2_f)
        del a_MF
        if need_b2 and scaled:  # db2[e] = sum of s[m] * dout[m]: a K = 1 ragged reduction
            db2_1D = w2_EFD.new_empty(E, 1, D)
            s_M1 = row_weights_M.to(d_out_MD.dtype).unsqueeze(1)
            ragged_reduce_mm(s_M1, d_out_MD, offsets_E, db2_1D)
            db2 = db2_1D.view(E, D)
        elif need_b2:
            db2 = db2_f.to(d_out_MD.dtype)
    dpre = pre.new_empty(M, _pre_width(F, activation))
    rowdot = None
    if scaled:
        rowdot = torch.zeros((F + 15) // 16, M, device=pre.device, dtype=torch.float32)
    ragged_mm(
        d_out_MD, w2_EFD.transpose(1, 2), offsets_E, dpre, epilogue=EPI_ACT_BWD,
        act=_act_code(activation), pre=pre, gated=gated, row_scale_M=row_weights_M,
        rowdot_NM=rowdot,
    )  # fmt: skip
    d_rw = empty()
    if scaled:
        d_rw = rowdot.sum(0)
        if b2_ED is not None:  # ds[m] += <dout[m], b2[e]>: an N = 1 grouped GEMM
            dot_M1 = d_out_MD.new_empty(M, 1)
            ragged_mm(d_out_MD, b2_ED.unsqueeze(2), offsets_E, dot_M1)
            d_rw += dot_M1.squeeze(1).float()
        d_rw = d_rw.to(row_weights_M.dtype)
    return dpre, dw2, db2, d_rw


@_bwd_act_op.register_fake
def _bwd_act_fake(d_out_MD, offsets_E, w2_EFD, b2_ED, pre, row_weights_M, activation, need_w,
                  need_b2):  # fmt: skip
    E, F, D = w2_EFD.shape
    empty = lambda: d_out_MD.new_empty(0)
    dw2 = d_out_MD.new_empty(E, F, D) if need_w else empty()
    db2 = d_out_MD.new_empty(E, D) if need_w and need_b2 else empty()
    d_rw = row_weights_M.new_empty(pre.shape[0]) if row_weights_M is not None else empty()
    return pre.new_empty(pre.shape[0], _pre_width(F, activation)), dw2, db2, d_rw


@torch.library.custom_op("moe::triton_expert_mlp_backward_input", mutates_args=())
def _bwd_input_op(
    dpre: Tensor,
    x_TD: Tensor,
    offsets_E: Tensor,
    w1_EDF: Tensor,
    w3_EDF: Tensor | None,
    token_ids_M: Tensor | None,
    activation: str,
    need_x: bool,
    need_w: bool,
    need_b1: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw1, dw3, db1) from dpre = [dh | dg]; the ones not asked for are empty."""
    check_device(dpre, x_TD, offsets_E, w1_EDF, w3_EDF, token_ids_M)
    gated = activation in GATED
    E, D, F = w1_EDF.shape
    M = dpre.shape[0]
    empty = lambda: x_TD.new_empty(0)
    dx = empty()
    if need_x:  # first: the weight gradients are not alive yet while dx_MD is
        dx_MD = x_TD.new_empty(M, D)
        w3_t = w3_EDF.transpose(1, 2) if gated else None
        ragged_mm(dpre, w1_EDF.transpose(1, 2), offsets_E, dx_MD, b2_EKN=w3_t, gated=gated)
        if token_ids_M is None:
            dx = dx_MD
        else:
            dx = rows_to_tokens(dx_MD, token_ids_M, offsets_E[-1], x_TD.shape[0])
        del dx_MD
    dw1, dw3, db1 = empty(), empty(), empty()
    if need_w:
        db1_f = torch.empty(E, F, device=x_TD.device, dtype=torch.float32) if need_b1 else None
        order = busiest_first(offsets_E)
        dw1 = w1_EDF.new_empty(E, D, F)
        dw3 = w1_EDF.new_empty(E, D, F) if gated else dw3  # one launch: dpre = [dh | dg]
        ragged_reduce_mm(
            x_TD, dpre if gated else dpre[:, :F], offsets_E, dw1, idx_M=token_ids_M,
            dbias_EJ=db1_f, order_E=order, out2_EIJ=dw3 if gated else None,
        )  # fmt: skip
        db1 = db1_f.to(x_TD.dtype) if need_b1 else db1
    return dx, dw1, dw3, db1


@_bwd_input_op.register_fake
def _bwd_input_fake(dpre, x_TD, offsets_E, w1_EDF, w3_EDF, token_ids_M, activation, need_x,
                    need_w, need_b1):  # fmt: skip
    E, D, F = w1_EDF.shape
    empty = lambda: x_TD.new_empty(0)
    dx = x_TD.new_empty(x_TD.shape) if need_x else empty()
    if not need_w:
        return dx, empty(), empty(), empty()
    dw3 = x_TD.new_empty(E, D, F) if activation in GATED else empty()
    db1 = x_TD.new_empty(E, F) if need_b1 else empty()
    return dx, x_TD.new_empty(E, D, F), dw3, db1


def _setup_context(ctx, inputs, output):
    (x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, token_ids_M, row_weights_M,
     activation, save, sum_to_rows) = inputs  # fmt: skip
    ctx.save_for_backward(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b2_ED, token_ids_M,
                          row_weights_M)  # fmt: skip
    # Kept on ctx, detached (no reference cycle through the graph), so backward can drop it
    # as soon as the activation backward has read it; pre never gets a gradient.
    ctx.pre = output[1].detach()
    ctx.set_materialize_grads(False)
    ctx.activation, ctx.saved_pre, ctx.sum_to_rows = activation, save, sum_to_rows
    ctx.has_b1, ctx.has_b2 = b1_EF is not None, b2_ED is not None


def _keep_graph() -> bool:
    """backward(retain_graph=True) is running: saved state must survive this backward."""
    try:
        return torch._C._autograd._get_current_graph_task_keep_graph()
    except RuntimeError:  # not inside an engine-run backward (tracing)
        return False


def _backward(ctx, dy, _d_pre):
    x_TD, offsets_E, w1, w2, w3, b2, ids, row_weights = ctx.saved_tensors
    if not ctx.saved_pre:
        raise RuntimeError("expert_mlp_triton: forward ran without saving activations for backward")
    if torch.is_grad_enabled():
        raise NotImplementedError("moe::triton_expert_mlp has no double backward")
    pre = ctx.pre
    if not _keep_graph():  # released when the step's pre-activation is read for the last time
        ctx.pre = None
    need = ctx.needs_input_grad
    need_x, need_w, need_rw = need[0], any(need[2:7]), need[8] and row_weights is not None
    D = w2.shape[2]
    if dy is None:
        dy = pre.new_zeros(x_TD.shape[0] if ctx.sum_to_rows else pre.shape[0], D)
    dy = dy.contiguous()
    # dout rows: the gathered token gradients (the adjoint of the sum into tokens), once
    d_out_MD = dy.index_select(0, ids) if ctx.sum_to_rows and ids is not None else dy
    del dy
    dpre, dw2, db2, d_rw = _bwd_act_op(
        d_out_MD, offsets_E, w2, b2, pre, row_weights, ctx.activation, need_w,
        ctx.has_b2 and need[6],
    )  # fmt: skip
    del pre, d_out_MD  # the pre-activation is released here, before the input step
    dx, dw1, dw3, db1 = _bwd_input_op(
        dpre, x_TD, offsets_E, w1, w3, ids, ctx.activation, need_x, need_w,
        ctx.has_b1 and need[5],
    )  # fmt: skip
    gated = ctx.activation in GATED
    return (
        dx if need_x else None,
        None,
        dw1 if need[2] else None,
        dw2 if need[3] else None,
        dw3 if need[4] and gated else None,
        db1 if need[5] else None,
        db2 if need[6] else None,
        None,
        d_rw if need_rw else None,
        None,
        None,
        None,
    )


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check_shapes(x, offsets, w1, w2, w3, b1, b2, activation, ids):
    E, D, F = w1.shape
    want = {"x_TD": (x, (x.shape[0], D)), "offsets_E": (offsets, (E,)), "w2_EFD": (w2, (E, F, D)),
            "w3_EDF": (w3, (E, D, F)), "b1_EF": (b1, (E, F)), "b2_ED": (b2, (E, D)),
            "token_ids_M": (ids, (ids.shape[0],) if ids is not None else None)}  # fmt: skip
    if activation not in GATED:
        want.pop("w3_EDF")
    for name, (t, shape) in want.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {shape} (w1_EDF is {(E, D, F)})"
            )
    if E < 1:
        raise ValueError("expert_mlp_triton needs at least one expert")


def expert_mlp_triton(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF=None, b1_EF=None, b2_ED=None,
                      activation="gelu", token_ids_M=None, row_weights_M=None,
                      sum_to_rows=False):  # fmt: skip
    """The expert MLP of every local expert on the Triton kernels (see expert_mlp.py).

    Weights and biases are cast to x's dtype and made contiguous (no-ops in the usual case;
    autograd takes the gradients back). fp32, fp16 and bf16; fp32 accumulation everywhere.
    row_weights_M (the combine weights) scale each row's activation before the second GEMM and
    get their gradient from the activation backward's epilogue; with sum_to_rows the output is
    y_TD, every row added into the x row it was read from (a gather-sum, no atomics).
    """
    _check_shapes(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, activation, token_ids_M)
    M = token_ids_M.shape[0] if token_ids_M is not None else x_TD.shape[0]
    if row_weights_M is not None and tuple(row_weights_M.shape) != (M,):
        raise ValueError(f"row_weights_M has shape {tuple(row_weights_M.shape)}, expected {(M,)}")
    dtype = x_TD.dtype
    prep = lambda t: None if t is None else t.to(dtype).contiguous()  # no-ops in the usual case
    x_TD = x_TD.contiguous()
    w1, w2, w3, b1, b2 = (prep(t) for t in (w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED))
    if activation not in GATED:
        w3 = None
    offsets = offsets_E.to(torch.int32).contiguous()
    ids = None if token_ids_M is None else token_ids_M.to(torch.int64).contiguous()
    rw = None if row_weights_M is None else row_weights_M.to(torch.float32).contiguous()
    tracked = (x_TD, w1, w2, w3, b1, b2, rw)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked)
    out, _ = _fwd_op(x_TD, offsets, w1, w2, w3, b1, b2, ids, rw, activation, save, sum_to_rows)
    return out
