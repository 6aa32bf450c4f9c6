"""Backward of `moe::expert_mlp` (torch backend) as three custom ops, so each saved or
intermediate [R, F] buffer dies as soon as its last reader is done (the caller drops it between
the ops; see torch_expert_mlp._backward):

  act step    (h_RF, g_RF, dy) -> dh_RF, dg_RF, dW2, db2, d_row_weights   then h, g are released
  input step  (dh_RF, dg_RF, x) -> dx, dW1, db1                           then dh is released
  gate step   (dg_RF, x) -> dW3                                           (swiglu only)

So the last weight gradient is allocated while only dg and one chunk of gathered x rows are
alive, not h, g, dh and dg. Per chunk of whole experts (moe/kernels/expert_chunks.py). The
activation backward is fused in place (activations.activation_backward_): dh reuses the
buffer of d(act), dg that of silu(h), no other [rows, F] temporary.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.kernels.activations import GATED, activation_backward_, apply_activation
from moe.kernels.combine import rows_into_tokens
from moe.kernels.expert_chunks import Chunk, chunks, host_readable
from moe.kernels.torch_grouped_mm import zero_tail_rows


def ids_of(gather_ids_R: Tensor | None, c: Chunk) -> Tensor | None:
    return None if gather_ids_R is None else gather_ids_R[c.rows]


def rows_of(t_ND: Tensor, ids: Tensor | None, c: Chunk) -> Tensor:
    """The chunk's rows of t: gathered by token ids, or a view."""
    return t_ND[c.rows] if ids is None else t_ND.index_select(0, ids)


def whole(cs: list[Chunk], R: int) -> bool:
    """One chunk of every row: its GEMM outputs are the full buffers (no copy into them)."""
    return len(cs) == 1 and cs[0].r0 == 0 and cs[0].r1 == R


class Grads:
    """Weight gradients [L, ...] written per chunk: the chunk's result itself when the chunk
    holds every expert (no copy), else a slice write; zeros where no chunk wrote (no rows)."""

    def __init__(self, L: int, shape: tuple, like: Tensor, need: bool):
        self.L, self.shape, self.like, self.need, self.value = L, shape, like, need, None

    def put(self, c: Chunk, value: Tensor) -> None:
        if c.e0 == 0 and c.e1 == self.L:
            self.value = value
            return
        if self.value is None:
            self.value = value.new_empty(self.shape)
        self.value[c.experts] = value

    def get(self) -> Tensor:
        if self.value is None:
            return self.like.new_zeros(self.shape if self.need else (0,))
        return self.value


@torch.library.custom_op("moe::expert_mlp_backward_act", mutates_args=())
def bwd_act_op(
    dy: Tensor,
    x_ND: Tensor,
    offsets_L: Tensor,
    w2_LFD: Tensor,
    b2_LD: Tensor | None,
    gather_ids_R: Tensor | None,
    row_weights_R: Tensor | None,
    h_RF: Tensor,
    g_RF: Tensor,
    activation: str,
    sum_to_tokens: bool,
    need_w2: bool,
    need_b2: bool,
    need_rw: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dh_RF, dg_RF, dW2, db2, d_row_weights): the steps that read h and g; the activation
    is recomputed per chunk. dg_RF is [R, 0] unless gated; dW2, db2, d_row_weights are empty
    where not asked. Rows no chunk covers (CPU: the dropped tail) are never read after."""
    L, F_, D = w2_LFD.shape
    R = h_RF.shape[0]
    gated = activation in GATED
    cpu = host_readable(x_ND)
    cs = chunks(offsets_L, R, x_ND.shape[1] * x_ND.element_size())
    one = whole(cs, R)
    dh_RF = None if one else h_RF.new_empty(R, F_)
    dg_RF = None if one and gated else h_RF.new_empty(R, F_ if gated else 0)
    dw2 = Grads(L, (L, F_, D), x_ND, need_w2)
    db2 = Grads(L, (L, D), x_ND, need_b2)
    d_rw = x_ND.new_zeros(0)
    if need_rw:
        d_rw = torch.zeros(R, dtype=row_weights_R.dtype, device=x_ND.device)
    dy = dy.contiguous()
    for c in cs:
        ids, rows = ids_of(gather_ids_R, c), c.rows
        h_nF = h_RF[rows]
        gate_nF = g_RF[rows] if gated else None
        silu_nF = F.silu(h_nF) if gated else None  # kept: its buffer becomes dg
        a_nF = silu_nF * gate_nF if gated else apply_activation(h_nF, activation)
        d_out_nD = rows_of(dy, ids, c) if sum_to_tokens else dy[rows]
        da_nF = c.mm(d_out_nD, w2_LFD.transpose(1, 2))  # d(scale * a), then d a
        scale_n1 = None
        if row_weights_R is not None:
            scale_n1 = row_weights_R[rows].to(a_nF.dtype).unsqueeze(1)
            if need_rw:
                d_scale_n = (da_nF * a_nF).sum(1)
                if b2_LD is not None:
                    d_scale_n += (d_out_nD * c.row_bias(b2_LD)).sum(1)
                if one and not cpu:  # tail rows of the device chunk hold garbage
                    d_scale_n = zero_tail_rows(d_scale_n.unsqueeze(1), c.offsets).squeeze(1)
                d_rw[rows] = d_scale_n
            a_nF *= scale_n1
            da_nF *= scale_n1
        if need_w2:
            dw2.put(c, c.wgrad(a_nF, d_out_nD))
        if need_b2:
            db2.put(c, c.bias_grad(d_out_nD if scale_n1 is None else d_out_nD * scale_n1))
        del a_nF, d_out_nD
        dh_nF, dg_nF = activation_backward_(da_nF, h_nF, activation, gate_nF, silu_nF)
        if one:
            dh_RF, dg_RF = dh_nF, (dg_nF if gated else dg_RF)
        else:  # CPU: a cache-warm chunk copied into the full buffer
            dh_RF[rows] = dh_nF
            if gated:
                dg_RF[rows] = dg_nF
    if dh_RF is None:  # no chunks: no experts
        dh_RF = h_RF.new_zeros(R, F_)
    return dh_RF, dg_RF, dw2.get(), db2.get(), d_rw


@bwd_act_op.register_fake
def _(dy, x_ND, offsets_L, w2_LFD, b2_LD, gather_ids_R, row_weights_R, h_RF, g_RF, activation,
      sum_to_tokens, need_w2, need_b2, need_rw):  # fmt: skip
    L, F_, D = w2_LFD.shape
    R = h_RF.shape[0]
    empty = lambda: x_ND.new_empty(0)
    return (
        h_RF.new_empty(R, F_),
        h_RF.new_empty(R, F_ if activation in GATED else 0),
        x_ND.new_empty(L, F_, D) if need_w2 else empty(),
        x_ND.new_empty(L, D) if need_b2 else empty(),
        row_weights_R.new_empty(R) if need_rw else empty(),
    )


@torch.library.custom_op("moe::expert_mlp_backward_input", mutates_args=())
def bwd_input_op(
    dh_RF: Tensor,
    dg_RF: Tensor,
    x_ND: Tensor,
    offsets_L: Tensor,
    w1_LDF: Tensor,
    w3_LDF: Tensor | None,
    gather_ids_R: Tensor | None,
    activation: str,
    need_x: bool,
    need_w1: bool,
    need_b1: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW1, db1) from dh (and dg for dx); empty where not asked. dx first: the weight
    gradient is not alive yet while the [rows, D] input gradient is."""
    L, D, F_ = w1_LDF.shape
    R = dh_RF.shape[0]
    cpu = host_readable(x_ND)
    gated = activation in GATED
    dx = None
    if need_x and cpu:
        dx = torch.zeros_like(x_ND)  # chunks add into it (CPU: tail rows are in none)
    dw1 = Grads(L, (L, D, F_), x_ND, need_w1)
    db1 = Grads(L, (L, F_), x_ND, need_b1)
    for c in chunks(offsets_L, R, x_ND.shape[1] * x_ND.element_size()):
        ids, rows = ids_of(gather_ids_R, c), c.rows
        dh_nF = dh_RF[rows]
        if need_x:
            dxb_nD = c.mm(dh_nF, w1_LDF.transpose(1, 2))
            if gated:
                dxb_nD += c.mm(dg_RF[rows], w3_LDF.transpose(1, 2))
            if not cpu:  # the device chunk: every row, tail rows excluded here
                dx = (
                    zero_tail_rows(dxb_nD, offsets_L)
                    if ids is None
                    else rows_into_tokens(dxb_nD, ids, x_ND.shape[0], offsets_L[-1])
                )
            elif ids is None:
                dx[rows] = dxb_nD
            else:  # the adjoint of the gather, in index order (deterministic on CPU)
                rows_into_tokens(dxb_nD, ids, x_ND.shape[0], into_TD=dx)
            del dxb_nD
        if need_b1:
            db1.put(c, c.bias_grad(dh_nF))
        if need_w1:
            dw1.put(c, c.wgrad(rows_of(x_ND, ids, c), dh_nF))
    if dx is None:  # not asked for: empty; no chunks (no experts): zeros
        dx = torch.zeros_like(x_ND) if need_x else x_ND.new_zeros(0)
    return dx, dw1.get(), db1.get()


@bwd_input_op.register_fake
def _(dh_RF, dg_RF, x_ND, offsets_L, w1_LDF, w3_LDF, gather_ids_R, activation, need_x, need_w1,
      need_b1):  # fmt: skip
    L, D, F_ = w1_LDF.shape
    empty = lambda: x_ND.new_empty(0)
    return (
        x_ND.new_empty(x_ND.shape) if need_x else empty(),
        x_ND.new_empty(L, D, F_) if need_w1 else empty(),
        x_ND.new_empty(L, F_) if need_b1 else empty(),
    )


@torch.library.custom_op("moe::expert_mlp_backward_gate", mutates_args=())
def bwd_gate_op(
    dg_RF: Tensor, x_ND: Tensor, offsets_L: Tensor, gather_ids_R: Tensor | None, L: int
) -> Tensor:
    """dW3 [L, D, F] = x_rows^T @ dg per expert (x rows gathered again, per chunk)."""
    R, F_ = dg_RF.shape
    dw3 = Grads(L, (L, x_ND.shape[1], F_), x_ND, True)
    for c in chunks(offsets_L, R, x_ND.shape[1] * x_ND.element_size()):
        ids = ids_of(gather_ids_R, c)
        dw3.put(c, c.wgrad(rows_of(x_ND, ids, c), dg_RF[c.rows]))
    return dw3.get()


@bwd_gate_op.register_fake
def _(dg_RF, x_ND, offsets_L, gather_ids_R, L):
    return x_ND.new_empty(L, x_ND.shape[1], dg_RF.shape[1])
