"""Ragged-reduction grouped GEMM for weight gradients: dW[e] = A[rows of e]^T @ B[rows of e].

The reduction length of expert e is its token count. One program owns one (e, I-tile, J-tile)
output tile and walks its expert's rows in order, so the result is deterministic (no split-K,
no atomics) and an expert with no rows stores exact zeros. Optionally also the bias gradient
db[e] = sum of B's rows of e, accumulated from the B tiles already loaded (I-tile-0 programs).

A's rows may be gathered through token_ids (x is never permuted). Compiled, a gathered A is
first copied once in expert order (T*k*d elements): every load of the row loop is then a
contiguous tile that the pipeliner can issue stages ahead, where a gather (load an index, then
the row it names) drains the pipeline every step (tools/triton_aot_check.py shows both). With
`out2_EIJ`, B holds two column blocks [B1 | B2] (dh | dg of SwiGLU) and one launch writes
out = A^T B1 and out2 = A^T B2 (dW1 and dW3 from one copy of A).

Tile order: experts busiest first; within an expert, GROUP_J column tiles sweep all row tiles
together, so B's tiles are read from DRAM once and A's expert rows stay in L2 while reused.
"""

import torch
import triton
import triton.language as tl

from moe.kernels.triton import lang as tlx
from moe.kernels.triton.common import (
    autotune_prune,
    dot_flags,
    interpreting,
    m_bucket,
    tile_configs,
)
from moe.kernels.triton.mma import mma


def _configs() -> list[triton.Config]:
    # rows: the tile sizes (in the names' order), num_warps, num_stages
    table = [(128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4)]
    table += [(128, 256, 64, 8, 3)]
    return tile_configs(("BLOCK_I", "BLOCK_J", "BLOCK_M"), table)


def _prune(configs, named_args, **kwargs):
    """Half the reduction step for 4-byte (fp32) operands so the stages fit in shared memory."""
    if named_args["a_ptr"].element_size() != 4:
        return configs
    half = lambda c: dict(c.kwargs, BLOCK_M=c.kwargs["BLOCK_M"] // 2)
    return [triton.Config(half(c), num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]


@triton.autotune(
    configs=_configs(),
    key=["E", "I", "J", "M_BUCKET", "GATHER", "HAS_DBIAS", "TWO_OUT"],
    prune_configs_by={"early_config_prune": autotune_prune(_prune)},
)
@triton.jit
def _ragged_reduce_kernel(
    a_ptr, idx_ptr, b_ptr, offsets_ptr, order_ptr, out_ptr, out2_ptr, dbias_ptr,
    M, I, J, E, M_BUCKET, stride_am, stride_bm, stride_oe, stride_oi, stride_dbe,
    GATHER: tl.constexpr, HAS_DBIAS: tl.constexpr, TWO_OUT: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, GROUP_J: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_i = tlx.cdiv(I, BLOCK_I)
    n_jh = tlx.cdiv(J, BLOCK_J)  # column tiles per output
    n_j = n_jh * (2 if TWO_OUT else 1)
    per_expert = n_i * n_j
    e = tl.load(order_ptr + pid // per_expert)  # busiest experts first (see ragged_reduce_mm)
    # GROUP_J column tiles sweep all row tiles: B tiles read once, A's rows reused from L2.
    t = pid % per_expert
    width = GROUP_J * n_i
    first_j = (t // width) * GROUP_J
    group_cols = tl.minimum(n_j - first_j, GROUP_J)
    pid_j = first_j + (t % width) % group_cols
    pid_i = (t % width) // group_cols
    half = (pid_j >= n_jh).to(tl.int32)  # TWO_OUT: 0 -> out (B1), 1 -> out2 (B2)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets_ptr + e)

    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = (pid_j - half * n_jh) * BLOCK_J + tl.arange(0, BLOCK_J)
    i_ok = offs_i < I
    j_ok = offs_j < J
    acc = tl.full([BLOCK_I, BLOCK_J], 0.0, tl.float32)
    dbias = tl.full([BLOCK_J], 0.0, tl.float32)
    b_cols = b_ptr + (half * J + offs_j)[None, :]
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < end
        rows64 = rows.to(tl.int64)
        if GATHER:
            src = tl.load(idx_ptr + rows64, mask=r_ok, other=0).to(tl.int64)
        else:
            src = rows64
        a = tl.load(
            a_ptr + src[None, :] * stride_am + offs_i[:, None],
            mask=i_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_cols + rows64[:, None] * stride_bm, mask=r_ok[:, None] & j_ok[None, :], other=0.0
        )
        acc = mma(a, b, acc, DOT_F32, PRECISION)
        if HAS_DBIAS:
            dbias += tlx.vsum(b.to(tl.float32), 0)

    e64 = e.to(tl.int64)
    out_off = e64 * stride_oe + offs_i[:, None].to(tl.int64) * stride_oi + offs_j[None, :]
    out_mask = i_ok[:, None] & j_ok[None, :]
    if half == 0:
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out2_ptr + out_off, acc.to(out2_ptr.dtype.element_ty), mask=out_mask)
    if HAS_DBIAS:
        db_ptrs = dbias_ptr + e64 * stride_dbe + offs_j
        db_ok = offs_j < tl.where((pid_i == 0) & (half == 0), J, 0)
        tl.store(db_ptrs, dbias.to(dbias_ptr.dtype.element_ty), mask=db_ok)


def busiest_first(offsets_E: torch.Tensor) -> torch.Tensor:
    """Experts by descending row count (int32, on the device, no host sync)."""
    counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return torch.argsort(counts, descending=True, stable=True).to(torch.int32)


def ragged_reduce_mm(
    a_MI: torch.Tensor,
    b_MJ: torch.Tensor,
    offsets_E: torch.Tensor,
    out_EIJ: torch.Tensor,
    *,
    idx_M: torch.Tensor | None = None,
    dbias_EJ: torch.Tensor | None = None,
    order_E: torch.Tensor | None = None,
    out2_EIJ: torch.Tensor | None = None,
    prepermute: bool | None = None,
) -> torch.Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e] (a's rows read at idx_M[m] if given); returns out.

    b_MJ has one row per expert row; rows at or past offsets[-1] are never read. Row-major
    last dimensions are required (a, b may be column slices of wider buffers). order_E (int32,
    from `busiest_first`) is the order experts' tiles are launched in: the longest reductions
    start first, so a Zipf-hot expert does not run alone at the end. It changes no result.
    out2_EIJ (same shape as out): b_MJ has 2J columns; out gets the first J, out2 the last J
    (dbias only the first). prepermute (default: when compiled) copies a's gathered rows once
    in expert order so the kernel's loads pipeline; every idx_M entry must then be a valid row.
    """
    E, I, J = out_EIJ.shape
    M = b_MJ.shape[0]
    assert a_MI.stride(1) == 1 and b_MJ.stride(1) == 1 and out_EIJ.stride(2) == 1
    if out2_EIJ is not None:
        assert out2_EIJ.shape == out_EIJ.shape and out2_EIJ.stride() == out_EIJ.stride()
        assert b_MJ.shape[1] == 2 * J, "with out2_EIJ, b_MJ holds [B1 | B2] (2J columns)"
    if E == 0 or I == 0 or J == 0:
        return out_EIJ
    if idx_M is not None and (not interpreting() if prepermute is None else prepermute):
        a_MI, idx_M = a_MI.index_select(0, idx_M), None  # T*k*I elements, contiguous loads
    dot_f32, precision = dot_flags(a_MI.dtype)
    order_E = busiest_first(offsets_E) if order_E is None else order_E
    two = out2_EIJ is not None

    def grid(meta):
        n_j = triton.cdiv(J, meta["BLOCK_J"]) * (2 if two else 1)
        return (E * triton.cdiv(I, meta["BLOCK_I"]) * n_j,)

    _ragged_reduce_kernel[grid](
        a_MI, idx_M if idx_M is not None else offsets_E, b_MJ, offsets_E, order_E, out_EIJ,
        out2_EIJ if two else out_EIJ, dbias_EJ if dbias_EJ is not None else out_EIJ,
        M, I, J, E, m_bucket(M), a_MI.stride(0), b_MJ.stride(0), out_EIJ.stride(0),
        out_EIJ.stride(1), dbias_EJ.stride(0) if dbias_EJ is not None else 0,
        GATHER=idx_M is not None, HAS_DBIAS=dbias_EJ is not None, TWO_OUT=two,
        DOT_F32=dot_f32, PRECISION=precision, GROUP_J=8,
    )  # fmt: skip
    return out_EIJ
