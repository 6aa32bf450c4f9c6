"""Row gather-sums over an inverse permutation: the combine and the un-permute of dx.

No float atomics anywhere: every output row is owned by one program that reads its source
rows in a fixed order, so results are bitwise reproducible.
  combine_fwd    y[t] = sum_j w[t, j] * out[rows[t, j]]                (fixed k per token)
  combine_bwd    d_out[rows[t, j]] = w[t, j] * dy[t] (a permutation write: each live row
                 belongs to one pair), dw[t, j] = <dy[t], out[rows[t, j]]>
  rows_to_tokens dx[t] = sum of dx_rows[m] over the rows m with token_ids[m] == t (any count),
                 through a stable sort of token_ids: the backward of gather-on-load;
                 given each token's rows (token_rows_TK, ascending), summed from them
                 directly (fixed k, rows at or past the live count skipped): no sort.
Row indices outside [0, M) contribute zero, so sentinel indices are safe.
"""

import torch
import triton
import triton.language as tl

from moe.kernels.triton import lang as tlx
from moe.kernels.triton.common import interpreting


def _blocks() -> tuple[int, int]:
    return (16, 16) if interpreting() else (16, 256)


@triton.jit
def _rows_f32(ptr, rows, stride, offs_d, row_ok, d_ok):
    """The [rows, BLOCK_D] tile of a row-major matrix as fp32; masked-off entries 0."""
    return tl.load(
        ptr + rows[:, None] * stride + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _gather_sum_kernel(
    src_ptr, rows_ptr, seg_ptr, w_ptr, out_ptr, live_ptr, T, D, M, KF, stride_s, stride_o,
    FIXED_K: tl.constexpr, WEIGHTED: tl.constexpr, LIVE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    toks = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = toks < T
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if FIXED_K:
        start = toks * KF
        count = tl.where(t_ok, KF, 0)
    else:
        start = tl.load(seg_ptr + toks, mask=t_ok, other=0)
        count = tl.load(seg_ptr + toks + 1, mask=t_ok, other=0) - start
    bound = M
    if LIVE:  # rows at or past the live count (dropped pairs) contribute zero
        bound = tl.load(live_ptr).to(tl.int64)
    acc = tl.full([BLOCK_T, BLOCK_D], 0.0, tl.float32)
    for j in range(0, tlx.vmax(count, 0)):
        ok = j < count
        row = tl.load(rows_ptr + start + j, mask=ok, other=0).to(tl.int64)
        ok = ok & (row >= 0) & (row < M) & (row < bound)
        v = _rows_f32(src_ptr, row, stride_s, offs_d, ok, d_ok)
        if WEIGHTED:
            w = tl.load(w_ptr + start + j, mask=ok, other=0.0).to(tl.float32)
            v = v * w[:, None]
        acc += v
    out_ptrs = out_ptr + toks[:, None] * stride_o + offs_d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_bwd_kernel(
    dy_ptr, out_ptr, rows_ptr, w_ptr, dout_ptr, dw_ptr, T, D, M, KF,
    stride_dy, stride_out, stride_dout,
    K_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    toks = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = toks < T
    kcol = tl.arange(0, K_POW2)
    dw = tl.full([BLOCK_T, K_POW2], 0.0, tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        dy = _rows_f32(dy_ptr, toks, stride_dy, offs_d, t_ok, d_ok)
        for j in range(0, KF):
            row = tl.load(rows_ptr + toks * KF + j, mask=t_ok, other=-1).to(tl.int64)
            w = tl.load(w_ptr + toks * KF + j, mask=t_ok, other=0.0).to(tl.float32)
            ok = t_ok & (row >= 0) & (row < M)
            v = _rows_f32(out_ptr, row, stride_out, offs_d, ok, d_ok)
            dw += tl.where(kcol[None, :] == j, tlx.vsum(dy * v, 1)[:, None], 0.0)
            # Zero-weight pairs (dropped pairs share one zero row) are skipped: their gradient
            # is 0, already there, and skipping keeps every row written by one pair at most.
            tl.store(
                dout_ptr + row[:, None] * stride_dout + offs_d[None, :],
                (w[:, None] * dy).to(dout_ptr.dtype.element_ty),
                mask=(ok & (w != 0.0))[:, None] & d_ok[None, :],
            )
    tl.store(
        dw_ptr + toks[:, None] * KF + kcol[None, :], dw, mask=t_ok[:, None] & (kcol[None, :] < KF)
    )


def combine_fwd(
    out_MD: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """y_TD in out_MD's dtype, fp32 accumulation."""
    T, K = rows_TK.shape
    M, D = out_MD.shape
    y = out_MD.new_empty(T, D)
    if T == 0 or D == 0:
        return y
    bt, bd = _blocks()
    grid = (triton.cdiv(T, bt), triton.cdiv(D, bd))
    _gather_sum_kernel[grid](
        out_MD, rows_TK, rows_TK, weights_TK, y, rows_TK, T, D, M, K, out_MD.stride(0),
        y.stride(0), FIXED_K=True, WEIGHTED=True, LIVE=False, BLOCK_T=bt, BLOCK_D=bd,
    )  # fmt: skip
    return y


def combine_bwd(dy_TD, out_MD, rows_TK, weights_TK) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_out_MD in out's dtype, zero on rows no pair uses; d_weights_TK in fp32)."""
    T, K = rows_TK.shape
    M, D = out_MD.shape
    d_out = torch.zeros_like(out_MD)
    dw = torch.zeros(T, K, dtype=torch.float32, device=out_MD.device)
    if T == 0 or K == 0:
        return d_out, dw
    bt, bd = _blocks()
    _combine_bwd_kernel[(triton.cdiv(T, bt),)](
        dy_TD, out_MD, rows_TK, weights_TK, d_out, dw, T, D, M, K,
        dy_TD.stride(0), out_MD.stride(0), d_out.stride(0),
        K_POW2=triton.next_power_of_2(K), BLOCK_T=bt, BLOCK_D=bd,
    )  # fmt: skip
    return d_out, dw


def rows_to_tokens(
    dx_MD: torch.Tensor,
    token_ids_M: torch.Tensor,
    live_rows: torch.Tensor,
    num_tokens: int,
    token_rows_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """dx_TD[t] = sum over live rows m (m < live_rows, a 0-d device tensor) with token_ids[m] == t.

    The inverse map is built on the device (stable sort + searchsorted), no host sync, or given:
    token_rows_TK (int64, contiguous), every token's rows in ascending order (sorted_token_rows).
    Either way rows are summed in ascending row order, in fp32.
    """
    M, D = dx_MD.shape
    dx_TD = dx_MD.new_empty(num_tokens, D)
    if num_tokens == 0 or D == 0:
        return dx_TD
    bt, bd = _blocks()
    grid = (triton.cdiv(num_tokens, bt), triton.cdiv(D, bd))
    if token_rows_TK is not None:
        _gather_sum_kernel[grid](
            dx_MD, token_rows_TK, token_rows_TK, token_rows_TK, dx_TD, live_rows.reshape(1),
            num_tokens, D, M, token_rows_TK.shape[1], dx_MD.stride(0), dx_TD.stride(0),
            FIXED_K=True, WEIGHTED=False, LIVE=True, BLOCK_T=bt, BLOCK_D=bd,
        )  # fmt: skip
        return dx_TD
    ids = token_ids_M.to(torch.int64)
    row = torch.arange(M, device=ids.device)
    key = torch.where(row < live_rows, ids, torch.full_like(ids, num_tokens))  # tail: sentinel
    key_sorted, perm = torch.sort(key, stable=True)
    bounds = torch.arange(num_tokens + 1, device=ids.device, dtype=torch.int64)
    seg = torch.searchsorted(key_sorted, bounds)
    _gather_sum_kernel[grid](
        dx_MD, perm, seg, perm, dx_TD, seg, num_tokens, D, M, 0, dx_MD.stride(0), dx_TD.stride(0),
        FIXED_K=False, WEIGHTED=False, LIVE=False, BLOCK_T=bt, BLOCK_D=bd,
    )  # fmt: skip
    return dx_TD


def sorted_token_rows(token_rows_TK: torch.Tensor) -> torch.Tensor:
    """Each token's rows in ascending order (int64, contiguous): rows_to_tokens' map, summed
    in the order the sort-built map sums them (so both give the same bits). One launch."""
    return torch.sort(token_rows_TK.to(torch.int64), dim=1).values.contiguous()
