"""Ragged-reduction grouped GEMM for weight gradients: dW[e] = A[rows of e]^T @ B[rows of e].

The reduction length of expert e is its token count. One program owns one (e, I-tile, J-tile)
output tile and walks its expert's rows in order, so the result is deterministic (no split-K,
no atomics) and an expert with no rows stores exact zeros. A's rows may be gathered through
token_ids (x is never permuted). Optionally also the bias gradient db[e] = sum of B's rows of
e, accumulated from the B tiles already loaded (stored by the I-tile-0 programs).
"""

import torch
import triton
import triton.language as tl

from moe.kernels.triton import lang as tlx
from moe.kernels.triton.common import autotune_prune, dot_flags, interpreting, m_bucket
from moe.kernels.triton.mma import mma


def _configs() -> list[triton.Config]:
    if interpreting():
        return [
            triton.Config({"BLOCK_I": 16, "BLOCK_J": 16, "BLOCK_M": 16}, num_warps=4, num_stages=1)
        ]
    c = triton.Config
    return [
        c({"BLOCK_I": 128, "BLOCK_J": 128, "BLOCK_M": 64}, num_warps=8, num_stages=3),
        c({"BLOCK_I": 128, "BLOCK_J": 128, "BLOCK_M": 32}, num_warps=4, num_stages=4),
        c({"BLOCK_I": 64, "BLOCK_J": 128, "BLOCK_M": 64}, num_warps=4, num_stages=4),
        c({"BLOCK_I": 128, "BLOCK_J": 256, "BLOCK_M": 64}, num_warps=8, num_stages=3),
    ]


def _prune(configs, named_args, **kwargs):
    """Half the reduction step for 4-byte (fp32) operands so the stages fit in shared memory."""
    if named_args["a_ptr"].element_size() != 4:
        return configs
    half = lambda c: dict(c.kwargs, BLOCK_M=c.kwargs["BLOCK_M"] // 2)
    return [triton.Config(half(c), num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]


@triton.autotune(
    configs=_configs(),
    key=["E", "I", "J", "M_BUCKET", "GATHER", "HAS_DBIAS"],
    prune_configs_by={"early_config_prune": autotune_prune(_prune)},
)
@triton.jit
def _ragged_reduce_kernel(
    a_ptr, idx_ptr, b_ptr, offsets_ptr, order_ptr, out_ptr, dbias_ptr,
    M, I, J, E, M_BUCKET, stride_am, stride_bm, stride_oe, stride_oi, stride_dbe,
    GATHER: tl.constexpr, HAS_DBIAS: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_i = tlx.cdiv(I, BLOCK_I)
    n_j = tlx.cdiv(J, BLOCK_J)
    e = tl.load(order_ptr + pid // (n_i * n_j))  # busiest experts first (see ragged_reduce_mm)
    pid_i = (pid % (n_i * n_j)) // n_j
    pid_j = pid % n_j
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets_ptr + e)

    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    i_ok = offs_i < I
    j_ok = offs_j < J
    acc = tl.full([BLOCK_I, BLOCK_J], 0.0, tl.float32)
    dbias = tl.full([BLOCK_J], 0.0, tl.float32)
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
            b_ptr + rows64[:, None] * stride_bm + offs_j[None, :],
            mask=r_ok[:, None] & j_ok[None, :],
            other=0.0,
        )
        acc = mma(a, b, acc, DOT_F32, PRECISION)
        if HAS_DBIAS:
            dbias += tlx.vsum(b.to(tl.float32), 0)

    e64 = e.to(tl.int64)
    out_ptrs = (
        out_ptr + e64 * stride_oe + offs_i[:, None].to(tl.int64) * stride_oi + offs_j[None, :]
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=i_ok[:, None] & j_ok[None, :])
    if HAS_DBIAS:
        db_ptrs = dbias_ptr + e64 * stride_dbe + offs_j
        tl.store(
            db_ptrs, dbias.to(dbias_ptr.dtype.element_ty), mask=offs_j < tl.where(pid_i == 0, J, 0)
        )


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
) -> torch.Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e] (a's rows read at idx_M[m] if given); returns out.

    b_MJ has one row per expert row; rows at or past offsets[-1] are never read. Row-major
    last dimensions are required (a, b may be column slices of wider buffers). order_E (int32,
    from `busiest_first`) is the order experts' tiles are launched in: the longest reductions
    start first, so a Zipf-hot expert does not run alone at the end. It changes no result.
    """
    E, I, J = out_EIJ.shape
    M = b_MJ.shape[0]
    assert a_MI.stride(1) == 1 and b_MJ.stride(1) == 1 and out_EIJ.stride(2) == 1
    if E == 0 or I == 0 or J == 0:
        return out_EIJ
    dot_f32, precision = dot_flags(a_MI.dtype)
    order_E = busiest_first(offsets_E) if order_E is None else order_E
    grid = lambda meta: (E * triton.cdiv(I, meta["BLOCK_I"]) * triton.cdiv(J, meta["BLOCK_J"]),)
    _ragged_reduce_kernel[grid](
        a_MI, idx_M if idx_M is not None else offsets_E, b_MJ, offsets_E, order_E, out_EIJ,
        dbias_EJ if dbias_EJ is not None else out_EIJ,
        M, I, J, E, m_bucket(M), a_MI.stride(0), b_MJ.stride(0), out_EIJ.stride(0),
        out_EIJ.stride(1), dbias_EJ.stride(0) if dbias_EJ is not None else 0,
        GATHER=idx_M is not None, HAS_DBIAS=dbias_EJ is not None, DOT_F32=dot_f32,
        PRECISION=precision,
    )  # fmt: skip
    return out_EIJ
