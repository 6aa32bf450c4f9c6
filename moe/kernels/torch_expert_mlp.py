"""The whole expert MLP on the torch backend as one custom op, `moe::expert_mlp` (+ its
backward `moe::expert_mlp_backward`): torch.compile sees one opaque node, and the host reads of
the group sizes inside cause no graph break.

Why one op and not a chain of grouped GEMMs (measured in bench/results/*-moe-layer.md):
- Gather on load: expert input rows are gathered from x inside the op, never saved; backward
  gathers them again. Only the pre-activation is saved; the activation is recomputed.
- Combine folded in: each row's activation is scaled by its combine weight before the second
  GEMM ([R, F], not [R, D]), and with `sum_to_rows` the output rows are added straight into
  their token's row of y (the combine as the second GEMM's epilogue): no [R, D] output.
- Chunks of whole experts (moe/kernels/expert_chunks.py): every [rows, D] buffer is a small,
  cache-warm chunk, computed as one bmm over equal groups or as ragged grouped GEMMs
  (torch._grouped_mm, per-expert matmuls as fallback for float64).
Deterministic: index_add on CPU accumulates in index order. On CUDA (the torch fallback when
Triton is absent) there is one chunk and no host read.
"""

import torch
from torch import Tensor

from moe.kernels.activations import GATED, activation_backward, apply_activation
from moe.kernels.expert_chunks import Chunk, chunks

NEEDS = ("x", "w1", "w2", "w3", "b1", "b2", "row_weights")


def _pre_width(F: int, activation: str) -> int:
    return 2 * F if activation in GATED else F


def _ids(gather_ids_R: Tensor | None, c: Chunk) -> Tensor | None:
    return None if gather_ids_R is None else gather_ids_R[c.rows]


def _rows_of(t_ND: Tensor, ids: Tensor | None, c: Chunk) -> Tensor:
    """The chunk's rows of t: gathered by token ids, or a view."""
    return t_ND[c.rows] if ids is None else t_ND.index_select(0, ids)


@torch.library.custom_op("moe::expert_mlp", mutates_args=())
def _fwd_op(
    x_ND: Tensor,
    offsets_E: Tensor,
    w1_EDF: Tensor,
    w2_EFD: Tensor,
    w3_EDF: Tensor | None,
    b1_EF: Tensor | None,
    b2_ED: Tensor | None,
    gather_ids_R: Tensor | None,
    row_weights_R: Tensor | None,
    activation: str,
    sum_to_rows: bool,
) -> tuple[Tensor, Tensor]:
    """(out, pre_RF): out_RD[r] = row_weights_R[r] * MLP(x[gather_ids_R[r]]) (tail rows
    zero), or with sum_to_rows out_ND[n] = sum of the rows gathered from x row n; pre_RF is the
    pre-activation ([h | g] for swiglu, tail rows zero), saved for backward."""
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    F, D = w1_EDF.shape[2], w2_EFD.shape[2]
    pre_RF = x_ND.new_empty(R, _pre_width(F, activation))
    out = x_ND.new_zeros(x_ND.shape[0], D) if sum_to_rows else x_ND.new_empty(R, D)
    kept = 0
    for c in chunks(offsets_E, R, x_ND.shape[1] * x_ND.element_size()):
        ids = _ids(gather_ids_R, c)
        xb_nD = _rows_of(x_ND, ids, c)
        h_nF = c.mm(xb_nD, w1_EDF)
        if b1_EF is not None:
            h_nF += c.row_bias(b1_EF)
        gate_nF = c.mm(xb_nD, w3_EDF) if activation in GATED else None
        pre_RF[c.rows, :F] = h_nF
        if gate_nF is not None:
            pre_RF[c.rows, F:] = gate_nF
        a_nF = apply_activation(h_nF, activation, gate_nF)
        scale_n1 = None
        if row_weights_R is not None:
            scale_n1 = row_weights_R[c.rows].to(a_nF.dtype).unsqueeze(1)
            a_nF *= scale_n1
        y_nD = c.mm(a_nF, w2_EFD)
        if b2_ED is not None:
            y_nD += c.row_bias(b2_ED) if scale_n1 is None else c.row_bias(b2_ED) * scale_n1
        if not sum_to_rows:
            out[c.rows] = y_nD
        elif ids is None:
            out[c.rows] += y_nD
        else:
            out.index_add_(0, ids, y_nD)
        kept = c.r1
    pre_RF[kept:] = 0
    if not sum_to_rows:
        out[kept:] = 0
    return out, pre_RF


@_fwd_op.register_fake
def _(x_ND, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, gather_ids_R, row_weights_R,
      activation, sum_to_rows):  # fmt: skip
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    F, D = w1_EDF.shape[2], w2_EFD.shape[2]
    out = x_ND.new_empty(x_ND.shape[0] if sum_to_rows else R, D)
    return out, x_ND.new_empty(R, _pre_width(F, activation))


@torch.library.custom_op("moe::expert_mlp_backward", mutates_args=())
def _bwd_op(
    dy: Tensor,
    x_ND: Tensor,
    offsets_E: Tensor,
    w1_EDF: Tensor,
    w2_EFD: Tensor,
    w3_EDF: Tensor | None,
    b2_ED: Tensor | None,
    gather_ids_R: Tensor | None,
    row_weights_R: Tensor | None,
    pre_RF: Tensor,
    activation: str,
    sum_to_rows: bool,
    needs: list[bool],
) -> list[Tensor]:
    """Gradients in NEEDS order (x, w1, w2, w3, b1, b2, row_weights); empty where not asked.
    Per chunk: the activation is recomputed from pre_RF and the input rows gathered again."""
    need = dict(zip(NEEDS, needs))
    E, D, F = w1_EDF.shape
    R = pre_RF.shape[0]
    dev = x_ND.device
    grads = {  # chunks cover every expert: only the scattered / tail-holding ones start at 0
        "x": torch.zeros_like(x_ND) if need["x"] else None,
        "w1": w1_EDF.new_empty(E, D, F) if need["w1"] else None,
        "w2": w2_EFD.new_empty(E, F, D) if need["w2"] else None,
        "w3": w1_EDF.new_empty(E, D, F) if need["w3"] else None,
        "b1": w1_EDF.new_empty(E, F) if need["b1"] else None,
        "b2": w1_EDF.new_empty(E, D) if need["b2"] else None,
        "row_weights": torch.zeros(R, dtype=row_weights_R.dtype, device=dev)
        if need["row_weights"]
        else None,
    }
    dy = dy.contiguous()
    gated = activation in GATED
    for c in chunks(offsets_E, R, x_ND.shape[1] * x_ND.element_size()):
        ids, rows, experts = _ids(gather_ids_R, c), c.rows, c.experts
        pre_nF = pre_RF[rows]
        h_nF, gate_nF = (pre_nF[:, :F], pre_nF[:, F:]) if gated else (pre_nF, None)
        a_nF = apply_activation(h_nF, activation, gate_nF)
        d_out_nD = _rows_of(dy, ids, c) if sum_to_rows else dy[rows]
        da_nF = c.mm(d_out_nD, w2_EFD.transpose(1, 2))  # d(scale * a), then d a
        scale_n1 = None
        if row_weights_R is not None:
            scale_n1 = row_weights_R[rows].to(a_nF.dtype).unsqueeze(1)
            if need["row_weights"]:
                d_scale_n = (da_nF * a_nF).sum(1)
                if b2_ED is not None:
                    d_scale_n += (d_out_nD * c.row_bias(b2_ED)).sum(1)
                grads["row_weights"][rows] = d_scale_n
            a_nF *= scale_n1
            da_nF *= scale_n1
        if need["w2"]:
            grads["w2"][experts] = c.wgrad(a_nF, d_out_nD)
        if need["b2"]:
            grads["b2"][experts] = c.bias_grad(
                d_out_nD if scale_n1 is None else d_out_nD * scale_n1
            )
        del a_nF, d_out_nD
        dh_nF, dgate_nF = activation_backward(da_nF, h_nF, activation, gate_nF)
        del da_nF
        if need["b1"]:
            grads["b1"][experts] = c.bias_grad(dh_nF)
        if need["w1"] or need["w3"]:
            xb_nD = _rows_of(x_ND, ids, c)
            grads["w1"][experts] = c.wgrad(xb_nD, dh_nF)
            if dgate_nF is not None:
                grads["w3"][experts] = c.wgrad(xb_nD, dgate_nF)
            del xb_nD
        if need["x"]:
            dxb_nD = c.mm(dh_nF, w1_EDF.transpose(1, 2))
            if dgate_nF is not None:
                dxb_nD += c.mm(dgate_nF, w3_EDF.transpose(1, 2))
            if ids is None:
                grads["x"][rows] = dxb_nD
            else:  # the adjoint of the gather, in index order (deterministic on CPU)
                grads["x"].index_add_(0, ids, dxb_nD)
    return [x_ND.new_empty(0) if grads[n] is None else grads[n] for n in NEEDS]


@_bwd_op.register_fake
def _(dy, x_ND, offsets_E, w1_EDF, w2_EFD, w3_EDF, b2_ED, gather_ids_R, row_weights_R,
      pre_RF, activation, sum_to_rows, needs):  # fmt: skip
    E, D, F = w1_EDF.shape
    shapes = {"x": x_ND.shape, "w1": (E, D, F), "w2": (E, F, D), "w3": (E, D, F),
              "b1": (E, F), "b2": (E, D), "row_weights": (pre_RF.shape[0],)}  # fmt: skip
    out = []
    for n, need in zip(NEEDS, needs):
        dtype = row_weights_R.dtype if n == "row_weights" and need else x_ND.dtype
        out.append(x_ND.new_empty(shapes[n] if need else (0,), dtype=dtype))
    return out


def _setup_context(ctx, inputs, output):
    x, offsets, w1, w2, w3, b1, b2, ids, row_weights, activation, sum_to_rows = inputs
    ctx.save_for_backward(x, offsets, w1, w2, w3, b2, ids, row_weights, output[1])
    ctx.set_materialize_grads(False)  # pre_RF never gets a gradient: no [R, F] zeros
    ctx.activation, ctx.sum_to_rows = activation, sum_to_rows
    ctx.has = {"w3": w3 is not None, "b1": b1 is not None, "b2": b2 is not None,
               "row_weights": row_weights is not None}  # fmt: skip


_GRAD_AT = dict(zip(NEEDS, [0, 2, 3, 4, 5, 6, 8]))  # input position of each gradient


def _backward(ctx, dy, _d_pre):
    x, offsets, w1, w2, w3, b2, ids, row_weights, pre = ctx.saved_tensors
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "moe::expert_mlp has no double backward (create_graph=True); compose "
            "moe.kernels.grouped_mm_torch calls for higher-order gradients"
        )
    needs = [ctx.needs_input_grad[_GRAD_AT[n]] and ctx.has.get(n, True) for n in NEEDS]
    if dy is None:
        dy = pre.new_zeros(x.shape[0] if ctx.sum_to_rows else pre.shape[0], w2.shape[2])
    grads = _bwd_op(dy, x, offsets, w1, w2, w3, b2, ids, row_weights, pre, ctx.activation,
                    ctx.sum_to_rows, needs)  # fmt: skip
    out = [None] * 11
    for n, need, g in zip(NEEDS, needs, grads):
        if need:
            out[_GRAD_AT[n]] = g
    return tuple(out)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def expert_mlp_fused(
    x_ND: Tensor,
    offsets_E: Tensor,
    w1_EDF: Tensor,
    w2_EFD: Tensor,
    w3_EDF: Tensor | None = None,
    b1_EF: Tensor | None = None,
    b2_ED: Tensor | None = None,
    activation: str = "gelu",
    gather_ids_R: Tensor | None = None,
    row_weights_R: Tensor | None = None,
    sum_to_rows: bool = False,
) -> Tensor:
    """out_RD[r] = row_weights_R[r] * MLP_e(x_ND[gather_ids_R[r]]) for row r of expert e,
    tail rows exactly zero; with sum_to_rows, out_ND[n] = the sum of the rows read from x row
    n (see moe/kernels/expert_mlp.py for the contract)."""
    c = lambda t: t if t is None else t.contiguous()
    out, _ = _fwd_op(
        x_ND.contiguous(), offsets_E.to(torch.int32), c(w1_EDF), c(w2_EFD), c(w3_EDF),
        c(b1_EF), c(b2_ED), gather_ids_R, row_weights_R, activation, sum_to_rows,
    )  # fmt: skip
    return out
