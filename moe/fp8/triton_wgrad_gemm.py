"""The FP8 weight-gradient grouped GEMM (issue 61): dw[e] = a_e^T b_e from e4m3 codes and
per-group column scales, one Triton launch, no host sync (the bf16 GEMM on the codes' values
it replaces read 2 bytes per element, written by the quantization as 2 more).

Operands, each written by the launch that quantizes it (moe/fp8/triton_quant.py's column part,
`column_codes`): a's codes TRANSPOSED [K, W] and b's [N, W] in a padded layout (row k holds
column k over the rows, each expert's rows from a 16-aligned start and zeros up to the next
multiple of 16; W = 16 * (ceil(M / 16) + E)), and one float32 scale per (scaling group,
column) [G, K], [G, N]. A scaling group is a contiguous range of one expert's rows: the
expert's rows (rowwise, groups = the offsets) or each 128-row tile of them (blockwise,
moe/fp8/triton_blocks.tile_ends). The rows, the GEMM's reduction, are the contiguous dimension
of both tiles: Hopper's FP8 wgmma takes both operands K-major only, and the aligned, padded
rows let every load be a 16-byte asynchronous copy, so the main loop is pipelined
(`python -m tools.triton_aot_check` checks wgmma, no spills, the pipelining).

One program owns one (expert, K tile, N tile) output tile and walks its expert's rows in order
(deterministic, no atomics); an expert with no rows writes zeros. Each block of rows' product
(one e4m3 MMA chain, at most 128 rows) is added to a float32 sum in registers (DeepGEMM's
promotion: Hopper's MMA keeps fewer bits in its own accumulator); blockwise, scaled by its
tile's column scales before it is added; rowwise, the expert's sum is scaled once. A product of two e4m3 codes
is exact in float32, so the result is the eager chain's (dequantize, float32 GEMM) up to the
order of float32 sums, special values included (a column whose group holds Inf or NaN: NaN).

Compiled, tl.dot takes float8e4nv tiles (fp32 accumulation); under TRITON_INTERPRET=1
(DECODE) the codes are decoded to float32 first (the interpreter reads e4m3's NaN code as 480)
and a bf16 result is rounded to nearest even before the store (the interpreter truncates).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from moe.fp8.triton_quant import _decode, _padded_start, quantize, round_bf16
from moe.kernels.triton.common import autotune_prune, interpreting, m_bucket

TILE = 128  # the blockwise recipe's scaling tile (moe/fp8/blockwise.py's BLOCK)


def _configs() -> list[triton.Config]:
    """BLOCK_K, BLOCK_N, BLOCK_M (rows: a divisor of TILE), warps, stages; one 16-wide tile
    under the interpreter."""
    table = [(128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4)]
    if interpreting():
        table = [(16, 16, 16, 4, 1)]
    names = ("BLOCK_K", "BLOCK_N", "BLOCK_M")
    return [
        triton.Config(dict(zip(names, row[:3]), STAGES=row[4]), num_warps=row[3], num_stages=row[4])
        for row in table
    ]


@triton.autotune(
    configs=_configs(), key=["K", "N", "M_BUCKET", "GROUP_ROWS"],
    prune_configs_by={"early_config_prune": autotune_prune()},
)  # fmt: skip
@triton.jit
def _fp8_wgrad_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, offsets_ptr, out_ptr, M, K, N, E, M_BUCKET, stride_a,
    stride_b, GROUP_ROWS: tl.constexpr, E_POW2: tl.constexpr, DECODE: tl.constexpr,
    GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """out[e, k, n] = sum over e's groups g of (sum over g's rows r of a[k, r] b[n, r]) *
    sa[g, k] * sb[g, n]; GROUP_ROWS 0: one group per expert (g = e), else tiles of that many
    rows from the expert's first row."""
    pid = tl.program_id(0)
    n_k = tl.cdiv(K, BLOCK_K)
    n_n = tl.cdiv(N, BLOCK_N)
    e = pid // (n_k * n_n)
    # within e: GROUP_K row tiles sweep the column tiles together, so each b tile is read from
    # DRAM once per GROUP_K row tiles, while those tiles' rows of a stay in L2
    t = pid % (n_k * n_n)
    first_k = (t // (GROUP_K * n_n)) * GROUP_K
    group_k = tl.minimum(n_k - first_k, GROUP_K)
    ks = (first_k + (t % (GROUP_K * n_n)) % group_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = ((t % (GROUP_K * n_n)) // group_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < K
    n_ok = ns < N
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    n = tl.load(offsets_ptr + e) - start
    first = tl.multiple_of(_padded_start(offsets_ptr, E, start, E_POW2), 16)  # e's rows here
    stop = tl.multiple_of(first + (n + 15) // 16 * 16, 16)  # then zeros up to a multiple of 16
    g0 = e
    if GROUP_ROWS > 0:  # e's first tile: after the tiles of the experts before it
        es = tl.arange(0, E_POW2)
        ends = tl.load(offsets_ptr + es, mask=es < E, other=0)
        begins = tl.load(offsets_ptr + es - 1, mask=(es > 0) & (es < E), other=0)
        g0 = tl.sum(tl.where(es < e, (ends - begins + GROUP_ROWS - 1) // GROUP_ROWS, 0), 0)
    a_rows = a_ptr + ks[:, None].to(tl.int64) * stride_a
    b_rows = b_ptr + ns[None, :].to(tl.int64) * stride_b
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    # tl.range with num_stages: the scales' loads are pipelined too, not only the dot's tiles
    for r0 in tl.range(first, stop, BLOCK_M, num_stages=STAGES):
        rows = r0 + tl.arange(0, BLOCK_M)
        r_ok = rows < stop
        a = tl.load(a_rows + rows[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_rows + rows[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if DECODE:
            a = _decode(a.to(tl.uint8, bitcast=True))
            b = _decode(b.to(tl.uint8, bitcast=True))
        # each block's partial (one e4m3 MMA chain of BLOCK_M rows) added to the float32 sum:
        # Hopper's MMA keeps fewer bits in its own sum (DeepGEMM promotes every 128 too)
        part = tl.dot(a, b, input_precision="ieee")
        if GROUP_ROWS > 0:  # this block's tile: its partial scaled, then added
            g = (g0 + (r0 - first) // GROUP_ROWS).to(tl.int64)
            sa = tl.load(sa_ptr + g * K + ks, mask=k_ok, other=1.0)
            sb = tl.load(sb_ptr + g * N + ns, mask=n_ok, other=1.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc += part
    if GROUP_ROWS == 0:
        sa = tl.load(sa_ptr + e * K + ks, mask=k_ok, other=1.0)
        sb = tl.load(sb_ptr + e * N + ns, mask=n_ok, other=1.0)
        acc = tl.where(n > 0, acc * sa[:, None] * sb[None, :], 0.0)
    if DECODE and out_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter truncates to
        acc = round_bf16(acc)  # bf16 where the GPU rounds: round to nearest even
    out = out_ptr + e.to(tl.int64) * K * N + ks[:, None].to(tl.int64) * N + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


def scaling_groups(offsets_E: Tensor, M: int, recipe: str) -> Tensor:
    """The weight gradient's scaling groups of M rows (int32 ends): each expert's rows
    (rowwise), each 128-row tile of each expert's rows (blockwise)."""
    if recipe == "rowwise":
        return offsets_E
    from moe.fp8.triton_blocks import tile_ends

    return tile_ends(offsets_E, M, TILE)


def column_codes(
    x: Tensor,
    groups: Tensor,
    offsets_E: Tensor,
    pow2: bool,
    floor: float,
    *,
    rows: bool = False,
    ids: Tensor | None = None,
    **kept,
) -> tuple:
    """(codes [K, W], scales [G, K]) of x [M, K]'s columns (rows read at ids) scaled within
    `groups`, in the padded layout this GEMM reads (offsets_E: the experts' row ends), in one
    launch; rows=True: x's row-wise (codes, scales) first, from the same launch; kept:
    quantize's row_scales and scale_block (x holds a forward's kept codes)."""
    q, s, qc, sc = quantize(x, pow2, floor, rows=rows, groups=groups, ids=ids, padded=offsets_E,
                            **kept)  # fmt: skip
    return ((q, s) if rows else ()) + (qc, sc)


@torch.library.custom_op("moe::fp8_wgrad_gemm", mutates_args=())
def _gemm_op(
    a_KM: Tensor,
    sa_GK: Tensor,
    b_NM: Tensor,
    sb_GN: Tensor,
    offsets_E: Tensor,
    M: int,
    group_rows: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """[E, K, N] in out_dtype (see the module docstring); a_KM, b_NM: e4m3 codes (or their
    uint8 view) of M rows in `column_codes`' padded layout."""
    (K, N), E = (a_KM.shape[0], b_NM.shape[0]), offsets_E.shape[0]
    width = 16 * (triton.cdiv(M, 16) + E)
    if a_KM.shape[1] != width or b_NM.shape[1] != width:
        raise ValueError(
            f"fp8_wgrad_gemm: codes of {M} rows of {E} experts are [K, {width}] (column_codes), "
            f"got {tuple(a_KM.shape)} and {tuple(b_NM.shape)}"
        )
    out = torch.empty((E, K, N), dtype=out_dtype, device=a_KM.device)
    if out.numel() == 0:
        return out
    if M == 0:
        return out.zero_()
    grid = lambda meta: (  # noqa: E731
        E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),
    )
    _fp8_wgrad_kernel[grid](
        a_KM.view(torch.float8_e4m3fn), b_NM.view(torch.float8_e4m3fn), sa_GK, sb_GN, offsets_E,
        out, M, K, N, E, m_bucket(M), width, width, GROUP_ROWS=group_rows,
        E_POW2=triton.next_power_of_2(E), DECODE=interpreting(), GROUP_K=8,
    )  # fmt: skip
    return out


@_gemm_op.register_fake
def _(a_KM, sa_GK, b_NM, sb_GN, offsets_E, M, group_rows, out_dtype):
    return a_KM.new_empty(offsets_E.shape[0], a_KM.shape[0], b_NM.shape[0], dtype=out_dtype)


def fp8_wgrad_gemm(a: tuple, b: tuple, offsets_E: Tensor, M: int, recipe: str, out_dtype):
    """dw[e] = a_e^T b_e in out_dtype from `column_codes`' (codes, scales) of both operands (M
    rows, scaled within `scaling_groups(offsets_E, M, recipe)`)."""
    group_rows = TILE if recipe == "blockwise" else 0
    return _gemm_op(*a, *b, offsets_E, M, group_rows, out_dtype)
