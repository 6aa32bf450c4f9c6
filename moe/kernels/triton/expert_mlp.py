"""Expert MLP on the Triton grouped GEMMs: custom ops (torch.compile-safe) with autograd.

Forward, 2 launches: up (gather on load + b1 + fused activation, w1 and w3 in one pass for
swiglu; saves the pre-activation when grad is needed) and down (+ b2).
Backward, at most 5 launches plus a sort for the un-permute:
  dpre = act'(pre) * (dout @ w2^T)         ragged rows, activation backward fused
  dx   = dpre @ w1^T (+ dg @ w3^T)         ragged rows, then summed to tokens via the inverse map
  dW2  = act^T @ dout, db2                 ragged reduction
  dW1  = x^T @ dh, db1 (x gathered)        ragged reduction (and dW3 = x^T @ dg for swiglu)
No host sync, no float atomics: deterministic, CUDA-graph capturable. The semantics are those of
moe/kernels/expert_mlp.py (the contract every backend follows).
"""

import torch
from torch import Tensor

from moe.kernels.activations import GATED
from moe.kernels.triton.activations import ACT_CODES
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
    activation: str,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out_MD, act_MF, pre) where pre = h (or [h | g] for swiglu) if `save`, else empty."""
    check_device(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, token_ids_M)
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
        pre=pre if save else None, save_pre=save, gated=gated,
    )  # fmt: skip
    out = x_TD.new_empty(M, D)
    ragged_mm(act, w2_EFD, offsets_E, out, epilogue=EPI_PLAIN, bias_EN=b2_ED)
    return out, act, pre


@_fwd_op.register_fake
def _fwd_fake(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, token_ids_M, activation, save):
    M = token_ids_M.shape[0] if token_ids_M is not None else x_TD.shape[0]
    F, D = w1_EDF.shape[2], w2_EFD.shape[2]
    pre = x_TD.new_empty(M, _pre_width(F, activation) if save else 0)
    return x_TD.new_empty(M, D), x_TD.new_empty(M, F), pre


@torch.library.custom_op("moe::triton_expert_mlp_backward", mutates_args=())
def _bwd_op(
    d_out_MD: Tensor,
    x_TD: Tensor,
    offsets_E: Tensor,
    w1_EDF: Tensor,
    w2_EFD: Tensor,
    w3_EDF: Tensor | None,
    act_MF: Tensor,
    pre: Tensor,
    token_ids_M: Tensor | None,
    activation: str,
    has_b1: bool,
    has_b2: bool,
    need_x: bool,
    need_w: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw1, dw2, dw3, db1, db2); the ones not asked for are empty tensors."""
    check_device(d_out_MD, x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, act_MF, pre, token_ids_M)
    code = _act_code(activation)
    gated = activation in GATED
    d_out_MD = d_out_MD.contiguous()
    E, D, F = w1_EDF.shape
    M = d_out_MD.shape[0]
    empty = lambda: x_TD.new_empty(0)  # a fresh one per output: outputs must not alias
    dpre = x_TD.new_empty(M, _pre_width(F, activation))
    w2_t = w2_EFD.transpose(1, 2)
    ragged_mm(d_out_MD, w2_t, offsets_E, dpre, epilogue=EPI_ACT_BWD, act=code, pre=pre, gated=gated)

    dx = empty()
    if need_x:
        dx_MD = x_TD.new_empty(M, D)
        w3_t = w3_EDF.transpose(1, 2) if gated else None
        ragged_mm(dpre, w1_EDF.transpose(1, 2), offsets_E, dx_MD, b2_EKN=w3_t, gated=gated)
        if token_ids_M is None:
            dx = dx_MD
        else:
            dx = rows_to_tokens(dx_MD, token_ids_M, offsets_E[-1], x_TD.shape[0])

    dw1, dw2, dw3, db1, db2 = (empty() for _ in range(5))
    if need_w:
        db1_f = torch.empty(E, F, device=x_TD.device, dtype=torch.float32) if has_b1 else None
        db2_f = torch.empty(E, D, device=x_TD.device, dtype=torch.float32) if has_b2 else None
        order = busiest_first(offsets_E)
        dw2 = w2_EFD.new_empty(E, F, D)
        ragged_reduce_mm(act_MF, d_out_MD, offsets_E, dw2, dbias_EJ=db2_f, order_E=order)
        dw1 = w1_EDF.new_empty(E, D, F)
        dw3 = w1_EDF.new_empty(E, D, F) if gated else dw3  # one launch: dpre = [dh | dg]
        ragged_reduce_mm(
            x_TD, dpre if gated else dpre[:, :F], offsets_E, dw1, idx_M=token_ids_M,
            dbias_EJ=db1_f, order_E=order, out2_EIJ=dw3 if gated else None,
        )  # fmt: skip
        db1 = db1_f.to(x_TD.dtype) if has_b1 else db1
        db2 = db2_f.to(x_TD.dtype) if has_b2 else db2
    return dx, dw1, dw2, dw3, db1, db2


@_bwd_op.register_fake
def _bwd_fake(d_out_MD, x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, act_MF, pre, token_ids_M,
              activation, has_b1, has_b2, need_x, need_w):  # fmt: skip
    E, D, F = w1_EDF.shape
    empty = lambda: x_TD.new_empty(0)
    dx = x_TD.new_empty(x_TD.shape) if need_x else empty()
    if not need_w:
        return dx, empty(), empty(), empty(), empty(), empty()
    dw3 = x_TD.new_empty(E, D, F) if activation in GATED else empty()
    db1 = x_TD.new_empty(E, F) if has_b1 else empty()
    db2 = x_TD.new_empty(E, D) if has_b2 else empty()
    return dx, x_TD.new_empty(E, D, F), x_TD.new_empty(E, F, D), dw3, db1, db2


def _setup_context(ctx, inputs, output):
    x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, token_ids_M, activation, save = inputs
    _, act_MF, pre = output
    ctx.save_for_backward(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, act_MF, pre, token_ids_M)
    ctx.activation = activation
    ctx.saved_pre = save
    ctx.has_b1, ctx.has_b2 = b1_EF is not None, b2_ED is not None


def _backward(ctx, d_out_MD, _d_act, _d_pre):
    x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, act_MF, pre, token_ids_M = ctx.saved_tensors
    if not ctx.saved_pre:
        raise RuntimeError("expert_mlp_triton: forward ran without saving activations for backward")
    need = ctx.needs_input_grad
    need_x, need_w = need[0], any(need[2:7])
    if d_out_MD is None:
        d_out_MD = act_MF.new_zeros(act_MF.shape[0], w2_EFD.shape[2])
    dx, dw1, dw2, dw3, db1, db2 = _bwd_op(
        d_out_MD, x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, act_MF, pre, token_ids_M,
        ctx.activation, ctx.has_b1, ctx.has_b2, need_x, need_w,
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
                      activation="gelu", token_ids_M=None):  # fmt: skip
    """The expert MLP of every local expert on the Triton kernels (see expert_mlp.py).

    Weights and biases are cast to x's dtype and made contiguous (no-ops in the usual case;
    autograd takes the gradients back). fp32, fp16 and bf16; fp32 accumulation everywhere.
    """
    _check_shapes(x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, activation, token_ids_M)
    dtype = x_TD.dtype
    prep = lambda t: None if t is None else t.to(dtype).contiguous()  # no-ops in the usual case
    x_TD = x_TD.contiguous()
    w1, w2, w3, b1, b2 = (prep(t) for t in (w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED))
    if activation not in GATED:
        w3 = None
    offsets = offsets_E.to(torch.int32).contiguous()
    ids = None if token_ids_M is None else token_ids_M.to(torch.int64).contiguous()
    tracked = (x_TD, w1, w2, w3, b1, b2)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked)
    out, _, _ = _fwd_op(x_TD, offsets, w1, w2, w3, b1, b2, ids, activation, save)
    return out
