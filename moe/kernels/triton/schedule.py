"""Device-side tile schedule of the ragged-rows grouped GEMM (no host sync, CUDA-graph safe).

Rows are sorted by expert: expert e owns rows [offsets[e-1], offsets[e]) and the rows from
offsets[E-1] to M (dropped pairs) form a tail segment E whose tiles only write zeros. Segment s
needs ceil(rows_s / BLOCK_M) row tiles; the GEMM grid is sized from the host-known bound
ceil(M / BLOCK_M) + E on the total, and every program maps its virtual row-tile id to
(segment, first row) with a cumulative sum over the E + 1 tile counts, computed in registers
from offsets_E. Programs past the real tile count get segment > E and exit. Because the map is
recomputed per program for its own BLOCK_M, autotuning may pick any BLOCK_M without a separate
schedule launch; the O(E) vector work is small next to a GEMM tile (E = 512: 1024 lanes).
"""

import torch
import triton
import triton.language as tl

from moe.kernels.triton import lang as tlx
from moe.kernels.triton.common import check_device, e_pow2


def max_row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_s ceil(rows_s / block_m) over the E expert segments and the tail."""
    return triton.cdiv(num_rows, block_m) + num_experts


@triton.jit
def expert_tile(tile, offsets_ptr, E, M, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Virtual row tile -> (segment, first row, segment end); segment E = tail, > E = no work."""
    seg = tl.arange(0, E_POW2)
    ends = tl.load(offsets_ptr + seg, mask=seg < E, other=0)
    ends = tl.where(seg < E, ends, M)
    starts = tl.load(offsets_ptr + seg - 1, mask=(seg >= 1) & (seg <= E), other=0)
    starts = tl.where(seg <= E, starts, M)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tlx.vcumsum(tiles, 0)
    s = tlx.vsum((cum <= tile).to(tl.int32), 0)
    here = seg == s
    first_tile = tlx.vsum(tl.where(here, cum - tiles, 0), 0)
    seg_start = tlx.vsum(tl.where(here, starts, 0), 0)
    seg_end = tlx.vsum(tl.where(here, ends, 0), 0)
    return s, seg_start + (tile - first_tile) * BLOCK_M, seg_end


@triton.jit
def grouped_tile(pid, M, N, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):  # fmt: skip
    """Program id -> (virtual row tile, column tile) in grouped order: GROUP_M consecutive row
    tiles (mostly one expert) sweep N together, so each expert's weight tiles are reused from
    L2. The row tiles are `max_row_tiles`' bound (ceil(M / BLOCK_M) + E)."""
    num_pid_m = tlx.cdiv(M, BLOCK_M) + E
    num_pid_n = tlx.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


@triton.jit
def _schedule_kernel(offsets_ptr, out_ptr, E, M, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    tile = tl.program_id(0)
    s, row0, seg_end = expert_tile(tile, offsets_ptr, E, M, BLOCK_M, E_POW2)
    tl.store(out_ptr + tile * 3 + 0, s)
    tl.store(out_ptr + tile * 3 + 1, row0)
    tl.store(out_ptr + tile * 3 + 2, seg_end)


def tile_schedule(offsets_E: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """The schedule the GEMM kernels use, materialised for inspection and tests.

    Returns int32 [max_row_tiles, 3]: (segment, first row, segment end) per virtual row tile;
    segment == E marks tail tiles (zero fill) and segment > E unused tiles.
    """
    check_device(offsets_E)
    offsets_E = offsets_E.to(torch.int32).contiguous()
    E = offsets_E.shape[0]
    n = max_row_tiles(num_rows, E, block_m)
    out = torch.empty(n, 3, dtype=torch.int32, device=offsets_E.device)
    _schedule_kernel[(n,)](offsets_E, out, E, num_rows, BLOCK_M=block_m, E_POW2=e_pow2(E))
    return out
