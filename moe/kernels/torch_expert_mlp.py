"""The whole expert MLP on the torch backend as one custom op, `moe::expert_mlp` (+ its
backward `moe::expert_mlp_backward`): torch.compile sees one opaque node, and the host reads of
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

from moe.kernels.activations import GATED, activation_backward, apply_activation
from moe.kernels.combine import rows_into_tokens
from moe.kernels.expert_chunks import Chunk, chunks, host_readable
from moe.kernels.expert_mlp import NO_ROWS_INFO, ExpertRows
from moe.kernels.torch_grouped_mm import zero_tail_rows

NEEDS = ("x", "w1", "w2", "w3", "b1", "b2", "row_weights")


def _ids(gather_ids_R: Tensor | None, c: Chunk) -> Tensor | None:
    return None if gather_ids_R is None else gather_ids_R[c.rows]


def _rows_of(t_ND: Tensor, ids: Tensor | None, c: Chunk) -> Tensor:
    """The chunk's rows of t: gathered by token ids, or a view."""
    return t_ND[c.rows] if ids is None else t_ND.index_select(0, ids)


def _whole(cs: list[Chunk], R: int) -> bool:
    """One chunk of every row: its GEMM outputs are the full buffers (no copy into them)."""
    return len(cs) == 1 and cs[0].r0 == 0 and cs[0].r1 == R


def _put(grads: dict, name: str, c: Chunk, L: int, value: Tensor) -> None:
    """Store expert slice c.experts of a weight gradient: the chunk's result itself when the
    chunk holds every expert (no copy into a preallocated tensor), else a slice write."""
    if c.e0 == 0 and c.e1 == L:
        grads[name] = value
        return
    if grads[name] is None:
        grads[name] = value.new_empty((L, *value.shape[1:]))
    grads[name][c.experts] = value


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
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, h_RF, g_RF): out_RD[r] = row_weights_R[r] * MLP(x[gather_ids_R[r]]) (tail rows
    zero), or with sum_to_tokens out_ND[n] = sum of the rows gathered from x row n; h_RF (and
    g_RF for swiglu, else empty) is the pre-activation saved for backward. Off the CPU (one
    chunk) the GEMM outputs are these buffers; their tail rows are never read and not zeroed."""
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    F, D = w1_LDF.shape[2], w2_LFD.shape[2]
    gated = activation in GATED
    cs = chunks(offsets_L, R, x_ND.shape[1] * x_ND.element_size())
    whole = _whole(cs, R)
    h_RF = None if whole else x_ND.new_empty(R, F)
    g_RF = None if whole and gated else x_ND.new_empty(R, F if gated else 0)
    scatter = sum_to_tokens and gather_ids_R is not None  # rows added into their tokens
    out = None if whole else x_ND.new_empty(R, D)
    if scatter and host_readable(x_ND):
        out = x_ND.new_zeros(x_ND.shape[0], D)
    kept = 0
    for c in cs:
        ids = _ids(gather_ids_R, c)
        xb_nD = _rows_of(x_ND, ids, c)
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
        if not scatter:
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
      activation, sum_to_tokens):  # fmt: skip
    R = gather_ids_R.shape[0] if gather_ids_R is not None else x_ND.shape[0]
    F, D = w1_LDF.shape[2], w2_LFD.shape[2]
    out = x_ND.new_empty(x_ND.shape[0] if sum_to_tokens else R, D)
    return out, x_ND.new_empty(R, F), x_ND.new_empty(R, F if activation in GATED else 0)


@torch.library.custom_op("moe::expert_mlp_backward", mutates_args=())
def _bwd_op(
    dy: Tensor,
    x_ND: Tensor,
    offsets_L: Tensor,
    w1_LDF: Tensor,
    w2_LFD: Tensor,
    w3_LDF: Tensor | None,
    b2_LD: Tensor | None,
    gather_ids_R: Tensor | None,
    row_weights_R: Tensor | None,
    h_RF: Tensor,
    g_RF: Tensor,
    activation: str,
    sum_to_tokens: bool,
    needs: list[bool],
) -> list[Tensor]:
    """Gradients in NEEDS order (x, w1, w2, w3, b1, b2, row_weights); empty where not asked.
    Per chunk: the activation is recomputed from h, g and the input rows gathered again."""
    need = dict(zip(NEEDS, needs))
    L, D, F = w1_LDF.shape
    R = h_RF.shape[0]
    cpu = host_readable(x_ND)
    grads = dict.fromkeys(NEEDS)
    if need["x"] and cpu:
        grads["x"] = torch.zeros_like(x_ND)  # chunks add into it (CPU: tail rows are in none)
    if need["row_weights"]:
        grads["row_weights"] = torch.zeros(R, dtype=row_weights_R.dtype, device=x_ND.device)
    dy = dy.contiguous()
    gated = activation in GATED
    cs = chunks(offsets_L, R, x_ND.shape[1] * x_ND.element_size())
    whole = _whole(cs, R)
    for c in cs:
        ids, rows = _ids(gather_ids_R, c), c.rows
        h_nF = h_RF[rows]
        gate_nF = g_RF[rows] if gated else None
        a_nF = apply_activation(h_nF, activation, gate_nF)
        d_out_nD = _rows_of(dy, ids, c) if sum_to_tokens else dy[rows]
        da_nF = c.mm(d_out_nD, w2_LFD.transpose(1, 2))  # d(scale * a), then d a
        scale_n1 = None
        if row_weights_R is not None:
            scale_n1 = row_weights_R[rows].to(a_nF.dtype).unsqueeze(1)
            if need["row_weights"]:
                d_scale_n = (da_nF * a_nF).sum(1)
                if b2_LD is not None:
                    d_scale_n += (d_out_nD * c.row_bias(b2_LD)).sum(1)
                if whole and not cpu:  # tail rows of the device chunk hold garbage
                    d_scale_n = zero_tail_rows(d_scale_n.unsqueeze(1), c.offsets).squeeze(1)
                grads["row_weights"][rows] = d_scale_n
            a_nF *= scale_n1
            da_nF *= scale_n1
        if need["w2"]:
            _put(grads, "w2", c, L, c.wgrad(a_nF, d_out_nD))
        if need["b2"]:
            d_b2 = d_out_nD if scale_n1 is None else d_out_nD * scale_n1
            _put(grads, "b2", c, L, c.bias_grad(d_b2))
        del a_nF, d_out_nD
        dh_nF, dgate_nF = activation_backward(da_nF, h_nF, activation, gate_nF)
        del da_nF, h_nF, gate_nF  # (h, g stay saved: backward may run again, retain_graph)
        if need["x"]:  # before the input-side weight gradients exist: a lower peak
            dxb_nD = c.mm(dh_nF, w1_LDF.transpose(1, 2))
            if dgate_nF is not None:
                dxb_nD += c.mm(dgate_nF, w3_LDF.transpose(1, 2))
            if not cpu:  # the device chunk: every row, tail rows excluded here
                grads["x"] = (
                    zero_tail_rows(dxb_nD, offsets_L)
                    if ids is None
                    else rows_into_tokens(dxb_nD, ids, x_ND.shape[0], offsets_L[-1])
                )
            elif ids is None:
                grads["x"][rows] = dxb_nD
            else:  # the adjoint of the gather, in index order (deterministic on CPU)
                rows_into_tokens(dxb_nD, ids, x_ND.shape[0], into_TD=grads["x"])
            del dxb_nD
        if need["b1"]:
            _put(grads, "b1", c, L, c.bias_grad(dh_nF))
        if need["w1"] or need["w3"]:
            xb_nD = _rows_of(x_ND, ids, c)
            _put(grads, "w1", c, L, c.wgrad(xb_nD, dh_nF))
            if dgate_nF is not None:
                _put(grads, "w3", c, L, c.wgrad(xb_nD, dgate_nF))
            del xb_nD
    shapes = {"x": x_ND.shape, "w1": (L, D, F), "w2": (L, F, D), "w3": (L, D, F),
              "b1": (L, F), "b2": (L, D)}  # fmt: skip
    for n in NEEDS:  # not asked for: empty; asked for but no chunk wrote it (no rows): zeros
        if grads[n] is None:
            grads[n] = x_ND.new_zeros(shapes[n] if need[n] else (0,))
    return [grads[n] for n in NEEDS]


@_bwd_op.register_fake
def _(dy, x_ND, offsets_L, w1_LDF, w2_LFD, w3_LDF, b2_LD, gather_ids_R, row_weights_R,
      h_RF, g_RF, activation, sum_to_tokens, needs):  # fmt: skip
    L, D, F = w1_LDF.shape
    shapes = {"x": x_ND.shape, "w1": (L, D, F), "w2": (L, F, D), "w3": (L, D, F),
              "b1": (L, F), "b2": (L, D), "row_weights": (h_RF.shape[0],)}  # fmt: skip
    out = []
    for n, need in zip(NEEDS, needs):
        dtype = row_weights_R.dtype if n == "row_weights" and need else x_ND.dtype
        out.append(x_ND.new_empty(shapes[n] if need else (0,), dtype=dtype))
    return out


def _setup_context(ctx, inputs, output):
    x, offsets, w1, w2, w3, b1, b2, ids, row_weights, activation, sum_to_tokens = inputs
    ctx.save_for_backward(x, offsets, w1, w2, w3, b2, ids, row_weights, output[1], output[2])
    ctx.set_materialize_grads(False)  # h, g never get a gradient: no [R, F] zeros
    ctx.activation, ctx.sum_to_tokens = activation, sum_to_tokens
    ctx.has = {"w3": w3 is not None, "b1": b1 is not None, "b2": b2 is not None,
               "row_weights": row_weights is not None}  # fmt: skip


_GRAD_AT = dict(zip(NEEDS, [0, 2, 3, 4, 5, 6, 8]))  # input position of each gradient


def _backward(ctx, dy, _d_h, _d_g):
    x, offsets, w1, w2, w3, b2, ids, row_weights, h, g = ctx.saved_tensors
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "moe::expert_mlp has no double backward (create_graph=True); compose "
            "moe.kernels.grouped_mm_torch calls for higher-order gradients"
        )
    needs = [ctx.needs_input_grad[_GRAD_AT[n]] and ctx.has.get(n, True) for n in NEEDS]
    if dy is None:
        dy = h.new_zeros(x.shape[0] if ctx.sum_to_tokens else h.shape[0], w2.shape[2])
    grads = _bwd_op(dy, x, offsets, w1, w2, w3, b2, ids, row_weights, h, g, ctx.activation,
                    ctx.sum_to_tokens, needs)  # fmt: skip
    out = [None] * 11
    for n, need, gr in zip(NEEDS, needs, grads):
        if need:
            out[_GRAD_AT[n]] = gr
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
        rows.sum_to_tokens,
    )  # fmt: skip
    return out_ND
