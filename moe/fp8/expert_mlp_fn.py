"""The FP8 expert MLP's rows part as one autograd.Function (up, gate, bias b1, activation,
row weight, down), so that its backward keeps x's e4m3 form (once, shared by the up and gate
GEMMs; x itself without save_fp8), the pre-activations h_RF, g_RF and, with save_fp8 and an
FP8 weight gradient, the down GEMM's e4m3 input as its forward quantized it (1 byte per
element: no recomputed activation and no second quantization in the backward), unless the
row weights need a gradient: then the activation is recomputed from h and g (for that
gradient) and quantized again (the same codes), as for the bf16 or unquantized weight
gradient. The backward's operands come from one launch each on CUDA
(moe/fp8/operands.py).

Same values as the chain of moe::fp8_grouped_mm calls and autograd ops it replaces: the same
quantizations (a kept form is the one the forward made) and aten derivative kernels."""

import torch
from torch import Tensor

from moe.fp8 import blockwise
from moe.fp8.grouped_mm import (
    _fwd_op,
    _fwd_quantized_op,
    _wgrad_op,
    quantize_input,
)
from moe.fp8.operands import GradOperand, kept_values, scaling_groups, wgrad_input
from moe.fp8.quant import group_of_rows
from moe.fp8.rows import gemm_input, plain
from moe.kernels.activations import activation_backward, apply_activation
from moe.kernels.torch_grouped_mm import wgrad_groups


def row_bias(b_LX: Tensor, group_R: Tensor) -> Tensor:
    """Each row's expert bias; rows past the last offset (group L) get zero."""
    padded = torch.cat([b_LX, b_LX.new_zeros(1, b_LX.shape[1])])
    return padded.index_select(0, group_R)


def _row_bias_grad(dh_RF: Tensor, group_R: Tensor, b_LF: Tensor) -> Tensor:
    """What autograd gives b through row_bias(b).to(h's dtype): an index_add, then the slice."""
    d = dh_RF.to(b_LF.dtype)
    return d.new_zeros(b_LF.shape[0] + 1, d.shape[1]).index_add_(0, group_R, d)[:-1]


def _activation(h_RF, g_RF, w_R1, activation):
    """(a_RF, a_RF * w_R1): the down GEMM's input, unweighted and weighted."""
    a_RF = apply_activation(h_RF, activation, g_RF)
    return a_RF, (a_RF if w_R1 is None else a_RF * w_R1)


def _gather(t: Tensor, ids_R: Tensor | None) -> Tensor:
    return t if ids_R is None else t.index_select(0, ids_R)


def _wgrad(x_RK: Tensor, dy_RN: Tensor, op: tuple, bf16: bool, w: Tensor) -> Tensor:
    """dw = x^T dy per expert in w's dtype: FP8 (moe::fp8_grouped_mm_wgrad), or with bf16
    (FP8Config.wgrad_bf16) the operands unquantized in dy's dtype on the plain grouped GEMM."""
    if bf16:
        return wgrad_groups(x_RK.to(dy_RN.dtype).contiguous(), dy_RN.contiguous(), op[0]).to(
            w.dtype
        )
    return _wgrad_op(x_RK, dy_RN, *op, w.dtype)


class _FP8MLP(torch.autograd.Function):
    """y_RD = down(act(up(x) + b1, gate(x)) * w_R1) with every GEMM in FP8; tail rows zero.
    x_ND's rows are quantized once, per token (rowwise and 1 x 128 scales are per row, so the
    same values as quantizing the gathered rows), and gathered as e4m3."""

    @staticmethod
    def forward(ctx, x_ND, ids_R, offsets_L, w1, w2, w3, b1, w_R1, activation, gemm):
        pow2, floor, save_fp8, recipe, _ = gemm
        q_x, s_x = gemm_input(x_ND, pow2, floor, recipe, ids_R is not None)  # (FP8 rows)
        q_R, s_R = _gather(q_x, ids_R), _gather(s_x, ids_R)
        ws = (w1,) if w3 is None else (w1, w3)
        fused = recipe == "blockwise" and blockwise.fused(q_R, w1, pow2)  # GEMMs on x's codes
        q_a = None
        if fused and blockwise.swiglu_epilogue(activation, w3, b1, w_R1, x_ND.dtype):
            # the up and gate GEMMs, the SwiGLU and the down GEMM's quantization: one launch
            h_RF, *g, q_a, s_a = blockwise.up_gate_swiglu(
                q_R, s_R, w1, w3, w_R1, offsets_L, pow2, floor, x_ND.dtype
            )
        elif fused:
            h_RF, *g = blockwise.from_codes(q_R, s_R, ws, offsets_L, pow2, floor, x_ND.dtype)
        else:
            h_RF, *g = (_fwd_quantized_op(q_R, s_R, w, offsets_L, pow2, floor, recipe, x_ND.dtype)
                        for w in ws)  # fmt: skip
        group_R = group_of_rows(offsets_L, q_R.shape[0]).long() if b1 is not None else None
        if b1 is not None:
            h_RF = h_RF + row_bias(b1, group_R).to(h_RF.dtype)
        g_RF = g[0] if g else None
        del q_R, s_R, g
        if q_a is None:
            _, a_w = _activation(h_RF, g_RF, w_R1, activation)
            y_RD, q_a, s_a = _fwd_op(a_w.contiguous(), w2, offsets_L, pow2, floor, save_fp8, recipe)
        else:
            y_RD = blockwise.block_gemm(q_a, s_a, w2, offsets_L, pow2, floor, x_ND.dtype)
        kept_x = (q_x, s_x) if save_fp8 else (plain(x_ND),)
        # the down GEMM's e4m3 input, unless the backward recomputes the activation anyway
        # (the row weights' gradient needs it) or takes it unquantized (bf16 weight gradient)
        d_rw = w_R1 is not None and ctx.needs_input_grad[7]
        kept_a = (q_a, s_a) if save_fp8 and not gemm[4] and not d_rw else ()
        ctx.save_for_backward(
            ids_R, offsets_L, group_R, w1, w2, w3, b1, w_R1, h_RF, g_RF, *kept_x, *kept_a
        )
        ctx.kept_x = len(kept_x)
        ctx.activation, ctx.gemm, ctx.x_shape = activation, gemm, (x_ND.shape, x_ND.dtype)
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        if torch.is_grad_enabled():
            raise NotImplementedError("the FP8 expert MLP has no double backward")
        ids_R, offsets_L, group_R, w1, w2, w3, b1, w_R1, h_RF, g_RF, *kept = ctx.saved_tensors
        kept_x, kept_a = kept[: ctx.kept_x], kept[ctx.kept_x :]
        pow2, floor, save_fp8, recipe, bf16_wgrad = ctx.gemm
        x_shape, x_dtype = ctx.x_shape
        op = (offsets_L, pow2, floor, recipe)
        need = ctx.needs_input_grad
        dy_RD = dy_RD.contiguous()
        d_rw_needed = w_R1 is not None and need[7]
        a_RF = a_w = None
        if d_rw_needed or (need[4] and not kept_a):  # recomputed where not kept
            a_RF, a_w = _activation(h_RF, g_RF, w_R1, ctx.activation)
        fp8_wgrad = not bf16_wgrad
        groups = scaling_groups(op, dy_RD.shape[0], dy_RD) if fp8_wgrad else None
        g_y = GradOperand(dy_RD, op, fp8_wgrad and need[4], groups)
        dw2 = None
        if need[4]:  # the down GEMM's input: its e4m3 form as the forward made it, or itself
            if bf16_wgrad:
                dw2 = _wgrad(a_w, dy_RD, op, True, w2)
            else:
                if not kept_a:
                    kept_a = (
                        quantize_input(a_w.contiguous(), pow2, floor, recipe)
                        if save_fp8
                        else (a_w,)
                    )
                dw2 = g_y.wgrad(wgrad_input(tuple(kept_a), None, op, groups), w2)
        del a_w
        da_w = g_y.dgrad(w2, x_dtype)
        del g_y
        d_rw = (da_w * a_RF).sum(1, keepdim=True) if d_rw_needed else None
        del a_RF
        da = da_w if w_R1 is None else da_w * w_R1
        dh, dg = activation_backward(da, h_RF, ctx.activation, g_RF)
        del da, da_w
        db1 = _row_bias_grad(dh, group_R, b1) if b1 is not None and need[6] else None
        g_h = GradOperand(dh.contiguous(), op, fp8_wgrad and need[3], groups)
        g_g = (
            GradOperand(dg.contiguous(), op, fp8_wgrad and need[5], groups)
            if dg is not None
            else None
        )
        dx = None
        if need[0]:  # with ids_R, each GEMM's rows summed into their tokens (index_select's
            # gradient) one after the other: no [R, D] sum of the two (fused blockwise: both
            # GEMMs in one launch, one sum)
            if g_g is not None and recipe == "blockwise" and blockwise.fused(dh, w1, pow2):
                parts = [blockwise.dgrad_pair(g_h.dy, g_g.dy, w1, w3, *op[:3], x_dtype)]
            else:
                parts = [g_h.dgrad(w1, x_dtype)]
                if g_g is not None:
                    parts.append(g_g.dgrad(w3, x_dtype))
            if ids_R is None:
                dx = parts[0] if len(parts) == 1 else parts[0] + parts[1]
            else:
                dx = parts[0].new_zeros(x_shape)
                for part in parts:
                    dx.index_add_(0, ids_R, part)
        x_RD = None
        if need[3] or need[5]:
            if bf16_wgrad:
                x_RD = kept_values(tuple(kept_x), ids_R, recipe, dh.dtype)
            else:
                x_RD = wgrad_input(tuple(kept_x), ids_R, op, groups)
        dw1 = dw3 = None
        if need[3]:
            dw1 = _wgrad(x_RD, dh, op, True, w1) if bf16_wgrad else g_h.wgrad(x_RD, w1)
        if g_g is not None and need[5]:
            dw3 = _wgrad(x_RD, dg, op, True, w3) if bf16_wgrad else g_g.wgrad(x_RD, w3)
        return dx, None, None, dw1, dw2, dw3, db1, d_rw, None, None


class SumToTokens(torch.autograd.Function):
    """y_ND = zeros.index_add(0, ids_R, y_RD) keeping only ids_R for the backward (autograd's
    index_add keeps y_RD too); the same values and gradient."""

    @staticmethod
    def forward(ctx, y_RD, ids_R, n):
        ctx.save_for_backward(ids_R)
        return y_RD.new_zeros(n, y_RD.shape[1]).index_add(0, ids_R, y_RD)

    @staticmethod
    def backward(ctx, dy_ND):
        (ids_R,) = ctx.saved_tensors
        return dy_ND.index_select(0, ids_R), None, None
