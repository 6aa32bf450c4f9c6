"""The whole expert MLP on the torch backend as one custom op, `moe::expert_mlp` (+ its
backward, three ops in torch_expert_mlp_backward.py): torch.compile sees one opaque node, and the host reads of
the group sizes inside cause no graph break.

Why one op and not a chain of grouped GEMMs (measured in bench/results/*-moe-layer.md):
- Gather on load: expert input rows are gathered from x inside the op, never saved; backward
  gathers them again. Only the pre-activation is saved; the activation is recomputed.
- Combine folded in: each row's activation is scaled by its combine weight before the second
  GEMM ([R, F], not [R, D]), and with `sum_to_tokens` the output rows are added straight into
  their token's row of y (moe/kernels/combine.py's rows_into_tokens, per chunk): no [R, D]
  output.
- Chunks of whole experts (moe/kernels/expert_chunks.py): every [rows, D] buffer is a small,
  cache-warm chunk, computed as one bmm over equal groups or as ragged grouped GEMMs
  (torch._grouped_mm, per-expert matmuls as fallback for float64).
Deterministic: on CPU rows_into_tokens adds in index order. On CUDA (the torch fallback when
Triton is absent) there is one chunk and no host read.
"""

import torch
from torch import Tensor

from moe.kernels.activations import GATED, apply_activation
from moe.kernels.combine import rows_into_tokens
from moe.kernels.expert_chunks import chunks, host_readable
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows
from moe.kernels.saved_tensors import save_for_backward_early_free, saved_early
from moe.kernels.torch_expert_mlp_backward import (
    bwd_act_op,
    bwd_gate_op,
    bwd_input_op,
    ids_of,
    rows_of,
)
from moe.kernels.torch_expert_mlp_backward import whole as is_whole
from moe.kernels.torch_grouped_mm import zero_tail_rows

NEEDS = ("x", "w1", "w2", "w3", "b1", "b2", "row_weights")


@torch.library.custom_op("moe::expert_mlp", mutates_args=())
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
    activation: str,
    sum_to_tokens: bool,
    all_rows_kept: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, h_RF, g_RF): out_RD[r] = row_weights_R[r] * MLP(x[gather_ids_R[r]]) (tail rows
    zero), or with sum_to_tokens out_ND[n] = sum of the rows gathered from x row n; h_RF (and
    g_RF for swiglu, else empty) is the pre-activation saved for backward. Off the CPU (one
    chunk) the GEMM outputs are these buffers; their tail rows are never read and not zeroed."""
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    F, D = w1_LDF.shape[2], w2_LFD.shape[2]
    gated = activation in GATED
    cs = chunks(offsets_L, R, x_ND.shape[1] * x_ND.element_size())
    whole = is_whole(cs, R)
    h_RF = None if whole else x_ND.new_empty(R, F)
    g_RF = None if whole and gated else x_ND.new_empty(R, F if gated else 0)
    scatter = sum_to_tokens and gather_ids_R is not None  # rows added into their tokens
    out = None if whole else x_ND.new_empty(R, D)
    if scatter and host_readable(x_ND):
        out = x_ND.new_zeros(x_ND.shape[0], D)
    kept = 0
    for c in cs:
        ids = ids_of(gather_ids_R, c)
        xb_nD = rows_of(x_ND, ids, c)
        h_nF = c.mm(xb_nD, w1_LDF)
        if b1_LF is not None:
            h_nF += c.row_bias(b1_LF)
        gate_nF = c.mm(xb_nD, w3_LDF) if gated else None
        del xb_nD
        if whole:
            h_RF, g_RF = h_nF, (gate_nF if gated else g_RF)
        else:  # CPU: a cache-warm chunk copied into the saved buffer
            h_RF[c.rows] = h_nF
            if gated:
                g_RF[c.rows] = gate_nF
        a_nF = apply_activation(h_nF, activation, gate_nF)
        scale_n1 = None
        if row_weights_R is not None:
            scale_n1 = row_weights_R[c.rows].to(a_nF.dtype).unsqueeze(1)
            a_nF *= scale_n1
        y_nD = c.mm(a_nF, w2_LFD)
        del a_nF
        if b2_LD is not None:
            y_nD += c.row_bias(b2_LD) if scale_n1 is None else c.row_bias(b2_LD) * scale_n1
        if not scatter:
            if whole:
                out = y_nD
            else:
                out[c.rows] = y_nD
        elif host_readable(x_ND):  # CPU chunks add into one y_TD, in index order
            out = rows_into_tokens(y_nD, ids, x_ND.shape[0], into_TD=out)
        else:  # the device chunk: a gather-sum of the live rows, no float atomics
            out = rows_into_tokens(y_nD, ids, x_ND.shape[0], offsets_L[-1])
        kept = c.r1
    if out is None:  # no chunks: no experts
        out = x_ND.new_zeros(x_ND.shape[0] if sum_to_tokens else R, D)
    if whole and not host_readable(x_ND):
        if not scatter and not all_rows_kept:
            out = zero_tail_rows(out, offsets_L)  # the returned rows' contract: tail rows zero
    elif h_RF is not None:
        h_RF[kept:] = 0
        g_RF[kept:] = 0
        if not scatter:
            out[kept:] = 0
    if h_RF is None:
        h_RF = x_ND.new_empty(R, F)
    return out, h_RF, g_RF


@_fwd_op.register_fake
def _(x_ND, offsets_L, w1_LDF, w2_LFD, w3_LDF, b1_LF, b2_LD, gather_ids_R, row_weights_R,
      activation, sum_to_tokens, all_rows_kept=False):  # fmt: skip
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    F, D = w1_LDF.shape[2], w2_LFD.shape[2]
    out = x_ND.new_empty(x_ND.shape[0] if sum_to_tokens else R, D)
    return out, x_ND.new_empty(R, F), x_ND.new_empty(R, F if activation in GATED else 0)


def _setup_context(ctx, inputs, output):
    x, offsets_L, w1, w2, w3, b1, b2, gather_ids_R, row_weights_R, activation, sum_to_tokens = (
        inputs[:11]
    )
    # h, g never get a gradient; backward drops them as soon as the act step has read them
    save_for_backward_early_free(
        ctx, (x, offsets_L, w1, w2, w3, b2, gather_ids_R, row_weights_R), (output[1], output[2])
    )
    ctx.set_materialize_grads(False)  # h, g never get a gradient: no [R, F] zeros
    ctx.activation, ctx.sum_to_tokens = activation, sum_to_tokens
    ctx.has = {"w3": w3 is not None, "b1": b1 is not None,
               "b2": b2 is not None, "row_weights": row_weights_R is not None}  # fmt: skip


_GRAD_AT = dict(zip(NEEDS, [0, 2, 3, 4, 5, 6, 8]))  # input position of each gradient


def _backward(ctx, dy, _d_h, _d_g):
    """Three ops (torch_expert_mlp_backward.py); h, g are released after the first and dh
    after the second unless the graph is retained."""
    (x, offsets_L, w1, w2, w3, b2, gather_ids_R, row_weights_R), (h, g) = saved_early(ctx)
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "moe::expert_mlp has no double backward (create_graph=True); compose "
            "moe.kernels.grouped_mm_torch calls for higher-order gradients"
        )
    need = {n: ctx.needs_input_grad[_GRAD_AT[n]] and ctx.has.get(n, True) for n in NEEDS}
    if dy is None:
        dy = h.new_zeros(x.shape[0] if ctx.sum_to_tokens else h.shape[0], w2.shape[2])
    dh, dg, dw2, db2, d_rw = bwd_act_op(
        dy, x, offsets_L, w2, b2, gather_ids_R, row_weights_R, h, g, ctx.activation,
        ctx.sum_to_tokens, need["w2"], need["b2"], need["row_weights"],
    )  # fmt: skip
    del h, g, dy
    dx, dw1, db1 = bwd_input_op(dh, dg, x, offsets_L, w1, w3, gather_ids_R, ctx.activation,
                                need["x"], need["w1"], need["b1"])  # fmt: skip
    del dh  # before dW3 exists: the step's peak holds dg alone
    dw3 = None
    if need["w3"]:  # (w3 given to a non-gated activation: unused, zero gradient)
        gated = ctx.activation in GATED
        dw3 = (
            bwd_gate_op(dg, x, offsets_L, gather_ids_R, w1.shape[0])
            if gated
            else torch.zeros_like(w3)
        )
    got = {"x": dx, "w1": dw1, "w2": dw2, "w3": dw3, "b1": db1, "b2": db2, "row_weights": d_rw}
    out = [None] * 12  # one per op input
    for n in NEEDS:
        if need[n]:
            out[_GRAD_AT[n]] = got[n]
    return tuple(out)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def expert_mlp_torch(
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
) -> Tensor:
    """out_RD[r] = row_weights_R[r] * MLP_e(x_ND[gather_ids_R[r]]) for row r of expert e,
    tail rows exactly zero; with rows.sum_to_tokens, y_TD[t] = the sum of the rows read from
    token t (see moe/kernels/expert_mlp.py for the contract)."""
    c = lambda t: t if t is None else t.contiguous()
    out_ND, _, _ = _fwd_op(
        x_ND.contiguous(), offsets_L.to(torch.int32), c(w1_LDF), c(w2_LFD), c(w3_LDF),
        c(b1_LF), c(b2_LD), rows.gather_ids_R, rows.row_weights_R, activation,
        rows.sum_to_tokens, rows.all_rows_kept,
    )  # fmt: skip
    return out_ND
