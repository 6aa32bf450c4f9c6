"""The blockwise recipe's operands in one Triton launch each on CUDA (issue 61): the weight's
128 x 128 blocks (codes in both orientations, [E, K, N] and [E, N, K], and one scale per
block: each of moe/fp8/triton_block_gemm.py's GEMMs reads its weight K-contiguous, the layout
Hopper's e4m3 wgmma takes from shared memory), and the ends of each expert's 128-row tiles
(the weight gradient's scaling groups) built on the device. The 1 x 128 activation blocks and
the per-tile columns are moe/fp8/triton_quant.py's row and column parts.
"""

import torch
import triton
import triton.language as tl

from moe.fp8.triton_quant import _cap, _decode, _e4m3_code, _nan_max, _scale

WEIGHT_CHUNK = 32  # rows of a block in registers at once


@triton.jit
def _weight_blocks_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, K, N, kb, nb, floor,
                          POW2: tl.constexpr, B: tl.constexpr, R: tl.constexpr):  # fmt: skip
    """One (e, i, j) block of B x B, in chunks of R rows (the amax, then the codes, written at
    (e, k, n) and (e, n, k))."""
    pid = tl.program_id(0)
    e = pid // (kb * nb)
    i = (pid % (kb * nb)) // nb
    j = pid % nb
    cols = j * B + tl.arange(0, B)
    base = e.to(tl.int64) * K * N
    amax = tl.zeros([B], dtype=tl.float32)
    for r0 in range(0, B, R):
        rows = i * B + r0 + tl.arange(0, R)
        ok = (rows < K)[:, None] & (cols < N)[None, :]
        at = base + rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(w_ptr + at, mask=ok, other=0.0).to(tl.float32)
        amax = _nan_max(amax, tl.reduce(tl.abs(x), 0, _nan_max))
    scale = _scale(tl.reduce(amax, 0, _nan_max), floor, POW2)
    tl.store(s_ptr + pid, scale)
    c = _cap(scale)
    for r0 in range(0, B, R):
        rows = i * B + r0 + tl.arange(0, R)
        ok = (rows < K)[:, None] & (cols < N)[None, :]
        at = base + rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(w_ptr + at, mask=ok, other=0.0).to(tl.float32)
        v = x / scale
        v = tl.where(v > c, c, tl.where(v < -c, -c, v))
        code = _e4m3_code(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        tl.store(q_ptr + at, code, mask=ok)
        tl.store(qt_ptr + base + cols[None, :].to(tl.int64) * K + rows[:, None], code, mask=ok)


def weight_blocks_triton(w_EKN: torch.Tensor, block: int, pow2: bool, floor: float):
    """(codes e4m3 [E, K, N], scales [E, kb, nb], the same codes as [E, N, K]) =
    quant.quantize_weight_blocks(w) and its codes transposed, in one launch."""
    E, K, N = w_EKN.shape
    kb, nb = triton.cdiv(K, block), triton.cdiv(N, block)
    w = w_EKN.detach().contiguous()
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((E, kb, nb), dtype=torch.float32, device=w.device)
    qt = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    if w.numel():
        _weight_blocks_kernel[(E * kb * nb,)](
            w, q, s, qt, K, N, kb, nb, float(floor), POW2=pow2, B=block, R=WEIGHT_CHUNK
        )
    return q, s, qt


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, M, K, nb, stride_qm,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    at = rows[:, None].to(tl.int64) * K + cols[None, :]
    code = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], mask=ok, other=0)
    scale = tl.load(s_ptr + rows[:, None].to(tl.int64) * nb + cols[None, :] // (K // nb),
                    mask=ok, other=1.0)  # fmt: skip
    tl.store(out_ptr + at, (_decode(code) * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_triton(q_MK: torch.Tensor, s_MB: torch.Tensor, dtype) -> torch.Tensor:
    """float32(q) x its 1 x (K / nb) block scale, in dtype (exact in bf16 with power-of-two
    scales), one launch; q: e4m3 codes (or their uint8 view) [M, K] with unit column stride
    (rows may be strided: a payload's codes in its packed rows), K a multiple of nb."""
    M, K = q_MK.shape
    out = torch.empty((M, K), dtype=dtype, device=q_MK.device)
    if M and K:
        grid = (triton.cdiv(M, 16), triton.cdiv(K, 128))
        _dequantize_kernel[grid](
            q_MK.view(torch.uint8),
            s_MB,
            out,
            M,
            K,
            s_MB.shape[1],
            q_MK.stride(0),
            BLOCK_M=16,
            BLOCK_K=128,
        )
    return out


def tile_ends(offsets_E: torch.Tensor, M: int, tile: int) -> torch.Tensor:
    """int32 [S]: where each tile of `tile` rows within each expert's rows ends, in row order
    (an expert's last tile partial), then offsets_E[-1] repeated (empty tiles) up to S =
    M // tile + E + 1, a bound known without reading the offsets; quant.row_tiles' segments."""
    E = offsets_E.shape[0]
    ends = offsets_E.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    n = (ends - starts + tile - 1) // tile
    c = torch.cumsum(n, 0)
    j = torch.arange(M // tile + E + 1, device=offsets_E.device)
    e = torch.searchsorted(c, j, right=True).clamp(max=E - 1)
    end = torch.minimum(starts[e] + (j - (c[e] - n[e]) + 1) * tile, ends[e])
    return torch.where(j < c[-1], end, ends[-1]).to(torch.int32)
