"""How moe::expert_mlp walks the expert rows: chunks of whole experts, each computed as one
batched matmul when its groups are equal (expert choice) or as ragged grouped GEMMs.

Why chunks: every [rows, D] buffer stays a small, cache-warm chunk. On CPU a fresh buffer over
glibc's mmap threshold costs more in page faults than the copy itself (64 MiB: ~25 ms against
~5 ms, bench/results/*-moe-layer.md), so full-size [T*k, D] buffers made the layer slow.
Why no padding: padding ragged groups to the busiest expert for one bmm was measured slower in
the layer at E=8 and E=64 and within noise at E=128 (bench/results/*-moe-layer.md, "ragged
vs padded"), so only groups that are already equal run as a bmm.
"""

from functools import cached_property

import torch
from torch import Tensor

from moe.kernels.torch_grouped_mm import mm_groups, wgrad_groups

CHUNK_BYTES = 8 << 20  # rows of one chunk times the row width in bytes


def host_readable(t: Tensor) -> bool:
    """Reading t on the host costs no device sync (CPU)."""
    return t.device.type == "cpu"


class Chunk:
    """Experts [e0, e1) and their rows [r0, r1) of the expert buffer."""

    def __init__(self, e0: int, e1: int, r0: int, r1: int, offsets_L: Tensor):
        self.e0, self.e1, self.r0, self.r1 = e0, e1, r0, r1
        self.rows, self.experts = slice(r0, r1), slice(e0, e1)
        self.offsets = offsets_L[e0:e1] - r0  # int32 row ends within the chunk
        n, L = r1 - r0, e1 - e0
        # > 0: every group has exactly this many rows (one bmm). Not for one group: a GEMM
        # either way, and the grouped path gives a lone expert the numbers it has among
        # others (the overlapped dispatcher computes one-expert chunks; tests/test_overlap.py)
        self.capacity = 0
        if host_readable(offsets_L) and n and L > 1 and n % L == 0:
            step = torch.arange(1, L + 1, dtype=offsets_L.dtype) * (n // L)
            self.capacity = n // L if torch.equal(self.offsets, step) else 0

    def mm(self, a_nK: Tensor, w_EKN: Tensor) -> Tensor:
        w = w_EKN[self.experts]
        if self.capacity:
            L, C = self.e1 - self.e0, self.capacity
            return torch.bmm(a_nK.view(L, C, -1), w).view(L * C, -1)
        return mm_groups(a_nK, w, self.offsets, zero_tail=False)  # tail rows: see expert_mlp

    def wgrad(self, a_nK: Tensor, d_nN: Tensor) -> Tensor:
        if self.capacity:
            L, C = self.e1 - self.e0, self.capacity
            return torch.bmm(a_nK.view(L, C, -1).transpose(1, 2), d_nN.view(L, C, -1))
        return wgrad_groups(a_nK, d_nN, self.offsets)

    @cached_property
    def expert_ids(self) -> Tensor:
        """long [n]: chunk-local expert of each row (E_c for tail rows)."""
        rows = torch.arange(self.r1 - self.r0, device=self.offsets.device)
        return torch.searchsorted(self.offsets, rows.to(self.offsets.dtype), right=True)

    def row_bias(self, b_EN: Tensor) -> Tensor:
        """b[expert of row]; tail rows (only in a device chunk) get zero."""
        b = b_EN[self.experts]
        return torch.cat([b, b.new_zeros(1, b.shape[1])]).index_select(0, self.expert_ids)

    def bias_grad(self, d_nN: Tensor) -> Tensor:
        acc = d_nN.new_zeros(self.e1 - self.e0 + 1, d_nN.shape[1])
        return acc.index_add_(0, self.expert_ids, d_nN)[:-1]


def chunks(offsets_L: Tensor, num_rows: int, row_bytes: int) -> list[Chunk]:
    """Whole experts per chunk, about CHUNK_BYTES of rows each, covering every expert. On the
    CPU tail rows (past offsets[-1]) are left out; elsewhere one chunk of all rows."""
    L = offsets_L.shape[0]
    if L == 0:
        return []
    if not host_readable(offsets_L):  # reading the offsets would sync the device
        return [Chunk(0, L, 0, num_rows, offsets_L)]
    rows_per_chunk = max(1, CHUNK_BYTES // max(row_bytes, 1))
    ends = offsets_L.tolist()
    starts = [0] + ends[:-1]
    bounds, first = [0], 0
    for e in range(1, L):  # host bookkeeping over L ints; the compute loop is per chunk
        if ends[e] - starts[first] > rows_per_chunk and ends[e - 1] > starts[first]:
            bounds.append(e)
            first = e
    bounds.append(L)
    return [Chunk(a, b, starts[a], ends[b - 1], offsets_L) for a, b in zip(bounds[:-1], bounds[1:])]
