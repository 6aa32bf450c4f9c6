"""Expert MLP on the Triton grouped GEMMs: custom ops (torch.compile-safe) with autograd.

Forward, 2 launches (+ a gather-sum with sum_to_tokens): up (gather on load + b1 + fused
activation, w1 and w3 in one pass for swiglu, times the row's combine weight; stores the
pre-activation when grad is needed) and down (+ b2). Only the pre-activation [M, F] ([M, 2F] for
swiglu) is kept for backward, on ctx (not as a differentiable output: no zero gradient is ever
materialised for it), and released as soon as the activation backward has read it.
Backward, three custom ops (expert_mlp_backward.py) so each buffer dies as soon as its last
reader is done; `_backward` here runs them in this order:
  act step:   a = s * act(pre) recomputed (one elementwise pass, kept for dW2: half of pre);
              dpre = act'(pre) * s * (dout @ w2^T), ds = <dout @ w2^T, act(pre)> per row
              (fused in the GEMM epilogue, 16-column partials summed after: no atomics)
              -> pre released
  input step: dx = dpre @ w1^T (+ dg @ w3^T), summed to tokens through the inverse map;
              dW1 = x^T @ dh, db1 (x gathered), dW3 = x^T @ dg  -> dpre released
  w2 step:    dW2 = a^T @ dout, db2 (the last weight gradient is written while only a and
              dout are alive, not pre or dpre)
No host sync, no float atomics: deterministic, CUDA-graph capturable. The semantics are those of
moe/kernels/expert_mlp.py (the contract every backend follows).
Each GEMM role (up, down, dact, dx, wgrad13, wgrad2) runs on the Triton kernel or, where
moe/kernels/gemm_roles.py names "cutlass" for it, on torch._grouped_mm (cutlass_roles.py);
`cutlass` (comma-separated role names) carries that choice into the ops.
"""

import torch
from torch import Tensor

from moe.kernels.activations import GATED
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows
from moe.kernels.kernel_config import kernel_config
from moe.kernels.saved_tensors import save_for_backward_early_free, saved_early
from moe.kernels.torch_grouped_mm import zero_tail_rows
from moe.kernels.triton import cutlass_roles as cutlass_mm
from moe.kernels.triton.activations import act_code, pre_width
from moe.kernels.triton.common import check_device, out_dtype_ok
from moe.kernels.triton.expert_mlp_backward import backward_act, backward_input, backward_w2
from moe.kernels.triton.gather_sum import rows_to_tokens, sorted_token_rows
from moe.kernels.triton.grouped_mm import EPI_ACT, EPI_PLAIN, ragged_mm
from moe.kernels.triton.grouped_mm_wgrad import busiest_first


def _num_out_rows(x_ND: Tensor, gather_ids_R: Tensor | None, sum_to_tokens: bool) -> int:
    if sum_to_tokens or gather_ids_R is None:
        return x_ND.shape[0]
    return gather_ids_R.shape[0]


@torch.library.custom_op("moe::triton_expert_mlp", mutates_args=())
def _fwd_op(
    x_ND: Tensor,
    offsets_L: Tensor,
    w1_LDF: Tensor,
    w2_LFD: Tensor,
    w3_LDF: Tensor | None,
    b1_LF: Tensor | None,
    b2_LD: Tensor | None,
    gather_ids_R: Tensor | None,
    row_weights_R: Tensor | None,
    token_rows_TK: Tensor | None,
    activation: str,
    save: bool,
    sum_to_tokens: bool,
    cutlass: str = "",
) -> tuple[Tensor, Tensor]:
    """(out, pre): out_RD[r] = row_weights_R[r] * MLP(x_ND[gather_ids_R[r]]) (tail rows zero),
    or with sum_to_tokens out_TD[t] = sum of the rows read from x row t (token_rows_TK: each
    token's rows, ascending, if known); pre = h (or [h | g] for swiglu) if `save`, else empty."""
    check_device(x_ND, offsets_L, w1_LDF, w2_LFD, w3_LDF, b1_LF, b2_LD, gather_ids_R, row_weights_R,
                 token_rows_TK)  # fmt: skip
    out_dtype_ok(x_ND.dtype)
    code = act_code(activation)
    gated = activation in GATED
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    F, D = w1_LDF.shape[2], w2_LFD.shape[2]
    w3 = w3_LDF if gated else None
    if cutlass_mm.on(cutlass, "up") and b1_LF is None and cutlass_mm.up_fits(x_ND, w1_LDF, w3):
        act, pre = cutlass_mm.up(
            x_ND, w1_LDF, w3, offsets_L, gather_ids_R, row_weights_R, activation, save
        )
    else:
        act = x_ND.new_empty(R, F)
        pre = x_ND.new_empty(R, pre_width(F, activation) if save else 0)
        ragged_mm(
            x_ND, w1_LDF, offsets_L, act, epilogue=EPI_ACT, act=code, b2_EKN=w3, bias_EN=b1_LF,
            idx_M=gather_ids_R, pre=pre if save else None, save_pre=save, gated=gated,
            row_scale_M=row_weights_R,
        )  # fmt: skip
    summed = sum_to_tokens and gather_ids_R is not None
    if cutlass_mm.on(cutlass, "down") and b2_LD is None and cutlass_mm.fits(act, w2_LFD):
        out = cutlass_mm.down(act, w2_LFD, offsets_L)
        if not summed:  # the rows returned: tail rows zero (the sum reads live rows only)
            zero_tail_rows(out, offsets_L)
    else:
        out = x_ND.new_empty(R, D)
        ragged_mm(act, w2_LFD, offsets_L, out, epilogue=EPI_PLAIN, bias_EN=b2_LD,
                  row_scale_M=row_weights_R)  # fmt: skip
    del act
    if summed:
        out = rows_to_tokens(out, gather_ids_R, offsets_L[-1], x_ND.shape[0], token_rows_TK)
    return out, pre


@_fwd_op.register_fake
def _fwd_fake(x_ND, offsets_L, w1_LDF, w2_LFD, w3_LDF, b1_LF, b2_LD, gather_ids_R, row_weights_R,
              token_rows_TK, activation, save, sum_to_tokens, cutlass=""):  # fmt: skip
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    F, D = w1_LDF.shape[2], w2_LFD.shape[2]
    pre = x_ND.new_empty(R, pre_width(F, activation) if save else 0)
    return x_ND.new_empty(_num_out_rows(x_ND, gather_ids_R, sum_to_tokens), D), pre


def _setup_context(ctx, inputs, output):
    (x_ND, offsets_L, w1_LDF, w2_LFD, w3_LDF, b1_LF, b2_LD, gather_ids_R, row_weights_R,
     token_rows_TK, activation, save, sum_to_tokens, cutlass) = inputs  # fmt: skip
    # pre never gets a gradient; backward drops it as soon as the activation step has read it
    inputs = (x_ND, offsets_L, w1_LDF, w2_LFD, w3_LDF, b2_LD, gather_ids_R, row_weights_R,
              token_rows_TK)  # fmt: skip
    save_for_backward_early_free(ctx, inputs, (output[1],))
    ctx.set_materialize_grads(False)
    ctx.activation, ctx.saved_pre, ctx.sum_to_tokens = activation, save, sum_to_tokens
    ctx.cutlass = cutlass
    ctx.has_b1, ctx.has_b2 = b1_LF is not None, b2_LD is not None


def _backward(ctx, dy, _d_pre):
    (x_ND, offsets_L, w1, w2, w3, b2, gather_ids_R, row_weights_R, token_rows_TK), (pre,) = (
        saved_early(ctx)
    )
    if not ctx.saved_pre:
        raise RuntimeError("expert_mlp_triton: forward ran without saving activations for backward")
    if torch.is_grad_enabled():
        raise NotImplementedError("moe::triton_expert_mlp has no double backward")
    need = ctx.needs_input_grad
    need_x, need_w, need_rw = need[0], any(need[2:7]), need[8] and row_weights_R is not None
    D = w2.shape[2]
    if dy is None:
        dy = pre.new_zeros(x_ND.shape[0] if ctx.sum_to_tokens else pre.shape[0], D)
    dy = dy.contiguous()
    # dout rows: the gathered token gradients (the adjoint of the sum into tokens), once
    d_out_RD = (
        dy.index_select(0, gather_ids_R) if ctx.sum_to_tokens and gather_ids_R is not None else dy
    )
    del dy
    dpre, a_RF, d_rw = backward_act(
        d_out_RD, offsets_L, w2, b2, pre, row_weights_R, ctx.activation, need_w, ctx.cutlass
    )
    del pre  # the pre-activation is released here, before the input step
    order_E = None  # the experts busiest first: one order for the Triton weight gradients
    if need_w and not all(cutlass_mm.on(ctx.cutlass, r) for r in ("wgrad13", "wgrad2")):
        order_E = busiest_first(offsets_L)
    dx, dw1, dw3, db1 = backward_input(
        dpre, x_ND, offsets_L, w1, w3, gather_ids_R, token_rows_TK, order_E, ctx.activation,
        need_x, need_w, ctx.has_b1 and need[5], ctx.cutlass,
    )  # fmt: skip
    del dpre  # released before the last weight gradient exists: dW2 comes last
    dw2 = db2 = None
    if need_w:
        dw2, db2 = backward_w2(
            a_RF, d_out_RD, offsets_L, row_weights_R, order_E, ctx.has_b2 and need[6], ctx.cutlass
        )
    del a_RF, d_out_RD
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
        None,
        None,
    )


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check_shapes(x, offsets, w1, w2, w3, b1, b2, activation, gather_ids_R):
    L, D, F = w1.shape
    want = {"x_ND": (x, (x.shape[0], D)), "offsets_L": (offsets, (L,)), "w2_LFD": (w2, (L, F, D)),
            "w3_LDF": (w3, (L, D, F)), "b1_LF": (b1, (L, F)), "b2_LD": (b2, (L, D)),
            "gather_ids_R": (gather_ids_R, (gather_ids_R.shape[0],) if gather_ids_R is not None else None)}  # fmt: skip
    if activation not in GATED:
        want.pop("w3_LDF")
    for name, (t, shape) in want.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {shape} (w1_LDF is {(L, D, F)})"
            )
    if L < 1:
        raise ValueError("expert_mlp_triton needs at least one expert")


def expert_mlp_triton(x_ND, offsets_L, w1_LDF, w2_LFD, w3_LDF=None, b1_LF=None, b2_LD=None, *,
                      activation="gelu", rows: ExpertRows = NO_ROWS_INFO,
                      cutlass_roles: tuple[str, ...] | None = None):  # fmt: skip
    """The expert MLP of every local expert on the Triton kernels (see expert_mlp.py).

    Weights and biases are cast to x's dtype and made contiguous (no-ops in the usual case;
    autograd takes the gradients back). fp32, fp16 and bf16; fp32 accumulation everywhere.
    rows.row_weights_R (the combine weights) scale each row's activation before the second GEMM
    and get their gradient from the activation backward's epilogue; with rows.sum_to_tokens the
    output is y_TD, every row added into the token it was read from (a gather-sum, no atomics).
    cutlass_roles: the GEMM roles run on CUTLASS (the kernel's setting, moe/kernels/
    triton_kernel.py); None: KernelConfig.roles_on_cutlass at this geometry.
    """
    gather_ids_R, row_weights_R, token_rows_TK = rows.gather_ids_R, rows.row_weights_R, None
    _check_shapes(x_ND, offsets_L, w1_LDF, w2_LFD, w3_LDF, b1_LF, b2_LD, activation, gather_ids_R)
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    if row_weights_R is not None and tuple(row_weights_R.shape) != (R,):
        raise ValueError(f"row_weights_R has shape {tuple(row_weights_R.shape)}, expected {(R,)}")
    dtype, D = x_ND.dtype, x_ND.shape[1]
    prep = lambda t: None if t is None else t.to(dtype).contiguous()  # no-ops in the usual case
    x_ND = x_ND.contiguous()
    w1, w2, w3, b1, b2 = (prep(t) for t in (w1_LDF, w2_LFD, w3_LDF, b1_LF, b2_LD))
    if activation not in GATED:
        w3 = None
    offsets = offsets_L.to(torch.int32).contiguous()
    if gather_ids_R is not None:
        gather_ids_R = gather_ids_R.to(torch.int64).contiguous()
        if rows.sum_to_tokens and rows.token_rows_TK is not None:  # the sum into tokens: no sort
            token_rows_TK = sorted_token_rows(rows.token_rows_TK)  # of the R row ids, twice
    if row_weights_R is not None:
        row_weights_R = row_weights_R.to(torch.float32).contiguous()
    if cutlass_roles is None:
        cutlass_roles = kernel_config().roles_on_cutlass(D, w1.shape[2])
    tracked = (x_ND, w1, w2, w3, b1, b2, row_weights_R)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tracked)
    out_ND, _ = _fwd_op(
        x_ND,
        offsets,
        w1,
        w2,
        w3,
        b1,
        b2,
        gather_ids_R,
        row_weights_R,
        token_rows_TK,
        activation,
        save,
        rows.sum_to_tokens,
        ",".join(cutlass_roles),
    )
    return out_ND
