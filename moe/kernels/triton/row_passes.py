"""Row passes for the GEMM roles that run on CUTLASS (torch._grouped_mm, moe/kernels/gemm_roles.py):
the work the Triton GEMMs do in their epilogues, as one pass each over the rows.

  act_bwd_rows   the dact role's epilogue: dpre = act'(pre) * s * da and, with row weights s,
                 ds = <da, act(pre)> per row (one program per block of rows looping over the
                 columns in a fixed order: no atomics, deterministic); optionally also
                 a = s * act(pre), dW2's operand, from the pre it reads anyway;
  zero_tail_blocks rows at or past offsets[-1] (dropped pairs) set to zero, reading the row
                 count on the device (no host sync) and touching only the tail: torch._grouped_mm
                 leaves those rows unwritten, and the expert MLP's contract says zero (the
                 device path of the one zero_tail_rows, moe/kernels/torch_grouped_mm.py).
Rows at or past offsets[-1] come out of act_bwd_rows as zeros too.
"""

import torch
import triton
import triton.language as tl

from moe.kernels.triton import lang as tlx
from moe.kernels.triton.activations import ACT_CODES, act_bwd, act_fwd
from moe.kernels.triton.common import interpreting


@triton.jit
def _act_bwd_rows_kernel(
    da_ptr, pre_ptr, scale_ptr, dpre_ptr, ds_ptr, live_ptr, act_ptr, M, F, stride_da, stride_pre,
    ACT: tl.constexpr, GATED: tl.constexpr, ROW_SCALE: tl.constexpr, SAVE_ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    live = tl.load(live_ptr).to(tl.int64)
    row_ok = rows < M
    keep = rows < live  # dropped rows: zero gradients
    s = tl.full([BLOCK_M], 1.0, tl.float32)
    if ROW_SCALE:
        s = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    s = tl.where(keep, s, 0.0)
    ds = tl.full([BLOCK_M], 0.0, tl.float32)  # tl.zeros: see lang.py
    P = F * (2 if GATED else 1)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        ok = row_ok[:, None] & (cols < F)[None, :]
        live_ok = ok & keep[:, None]
        da = tl.load(da_ptr + rows[:, None] * stride_da + cols[None, :], mask=live_ok, other=0.0)
        da = da.to(tl.float32)
        pre = pre_ptr + rows[:, None] * stride_pre + cols[None, :]
        h = tl.load(pre, mask=live_ok, other=0.0).to(tl.float32)
        g = h
        if GATED:
            g = tl.load(pre + F, mask=live_ok, other=0.0).to(tl.float32)
        a = act_fwd(h, g, ACT)
        if ROW_SCALE:
            ds += tlx.vsum(da * a, 1)
        if SAVE_ACT:  # dropped rows: 0
            a = tl.where(keep[:, None], a * s[:, None], 0.0)
            tl.store(act_ptr + rows[:, None] * F + cols[None, :], a.to(act_ptr.dtype.element_ty),
                     mask=ok)  # fmt: skip
        dh, dg = act_bwd(da * s[:, None], h, g, ACT)
        out = dpre_ptr + rows[:, None] * P + cols[None, :]
        tl.store(out, dh.to(dpre_ptr.dtype.element_ty), mask=ok)
        if GATED:
            tl.store(out + F, dg.to(dpre_ptr.dtype.element_ty), mask=ok)
    if ROW_SCALE:
        tl.store(ds_ptr + rows, tl.where(keep, ds, 0.0), mask=row_ok)


def act_bwd_rows(da_MF, pre_MP, activation: str, row_scale_M, offsets_L, act_out=None):
    """(dpre_MP, ds_M): dpre = act'(pre) * s * da ([dh | dg] for swiglu); ds (fp32, the row
    weights' gradient) = <da, act(pre)> per row when row_scale_M is given, else None. da is
    dL/d(s * act). Rows at or past offsets_L[-1] get zeros. act_out (contiguous [M, F]): also
    written, s * act(pre) (dW2's operand)."""
    from moe.kernels.activations import GATED

    M, F = da_MF.shape
    gated = activation in GATED
    dpre = pre_MP.new_empty(M, 2 * F if gated else F)
    scaled = row_scale_M is not None
    ds = torch.empty(M if scaled else 0, device=da_MF.device, dtype=torch.float32)
    if M == 0 or F == 0:
        return dpre.zero_(), (ds.zero_() if scaled else None)
    assert act_out is None or (act_out.shape, act_out.stride()) == ((M, F), (F, 1))
    bm, bf = (16, 16) if interpreting() else (16, 128)
    _act_bwd_rows_kernel[(triton.cdiv(M, bm),)](
        da_MF, pre_MP, row_scale_M if scaled else ds, dpre, ds, offsets_L[-1:],
        act_out if act_out is not None else dpre, M, F, da_MF.stride(0), pre_MP.stride(0),
        ACT=ACT_CODES[activation], GATED=gated, ROW_SCALE=scaled, SAVE_ACT=act_out is not None,
        BLOCK_M=bm, BLOCK_F=bf,
    )  # fmt: skip
    return dpre, (ds if scaled else None)


@triton.jit
def _zero_tail_kernel(y_ptr, live_ptr, M, N, stride_m, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    live = tl.load(live_ptr).to(tl.int64)
    if tl.program_id(0) * BLOCK_M + BLOCK_M > live:  # blocks of live rows return at once
        tail = (rows >= live) & (rows < M)
        zero = tl.full([BLOCK_M, BLOCK_N], 0.0, y_ptr.dtype.element_ty)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            ptrs = y_ptr + rows[:, None] * stride_m + cols[None, :]
            tl.store(ptrs, zero, mask=tail[:, None] & (cols < N)[None, :])


def zero_tail_blocks(y_MN: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """Zero the rows of y at or past offsets_L[-1] in place (only the tail's blocks); returns
    y. Called by the one zero_tail_rows (moe/kernels/torch_grouped_mm.py) off the CPU."""
    M, N = y_MN.shape
    if M == 0 or N == 0:
        return y_MN
    bm, bn = (16, 16) if interpreting() else (32, 128)
    _zero_tail_kernel[(triton.cdiv(M, bm),)](
        y_MN, offsets_L[-1:], M, N, y_MN.stride(0), BLOCK_M=bm, BLOCK_N=bn
    )
    return y_MN
