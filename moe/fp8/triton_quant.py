"""e4m3 quantization in ONE Triton launch per operand (issue 61): both orientations a GEMM
and its weight gradient need, each with its scales, where the eager chain (amax, scale, cap,
clamp, cast per operand and orientation) issues ~20 kernels and float32 intermediates:

- rows: per row of x [M, K] the amax, the scale (moe.fp8.quant.scale_of: max(amax, floor) /
  448, rounded up to a power of two with pow2), the cap (quant.e4m3_cap) and the clamped,
  rounded e4m3 codes (quant.quantize_along(x, -1));
- columns within groups: per column within each group of rows (an expert's tokens, or a
  128-row tile of them; a weight's K rows), the same, written as e4m3 codes into the
  TRANSPOSED copy (group g's block [K, rows of g]: column-major as torch._scaled_grouped_mm
  takes a weight, or the padded layout the FP8 weight-gradient GEMM reads,
  moe/fp8/triton_wgrad_gemm.py) with one scale per (group, column): quant.quantize_groups(x).

One launch runs both: its first programs quantize row blocks, the others (group, column
block) tiles. The input rows may be gathered (x[ids]) and may be e4m3 codes with row scales
(dequantized on load, float32: what a backward kept), so the weight gradient's operand comes
from a forward's kept codes in the same launch. Same codes, scales and values bit for bit as
the eager chain, special values included (a row or group column holding Inf or NaN gets a
non-finite scale and dequantizes to NaN; the floor keeps zero rows zero and tiny rows at full
precision).

The rounding to e4m3 is done in float32 (round to nearest even on e4m3's grid, by adding and
subtracting a power of two) and the code's bits are assembled (and read back) as integers, so
no float8 cast is left to the compiler: Triton's interpreter truncates where the GPU rounds, and
reads the NaN code as 480; this way both give torch's codes (a NaN's sign aside, which no device
fixes). The launchers run on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

import math

import torch
import triton
import triton.language as tl

# constexpr: a compiled kernel reads only constexpr globals (the interpreter reads any)
E4M3_MAX = tl.constexpr(448.0)
F32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _nan_max(a, b):
    return tl.where((a != a) | (a > b), a, b)


@triton.jit
def _e4m3_abs(v):
    """|v| (within e4m3's range) rounded to nearest even on e4m3's grid, in float32: steps of
    2^(e - 3) in binade e, 2^-9 below 2^-6; by adding and subtracting a power of two."""
    a = tl.abs(v)
    a_e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    magic = tl.exp2((tl.maximum(a_e, -6) - 3 + 23).to(tl.float32)) * 1.5
    return (a + magic) - magic


@triton.jit
def _cap(scale):
    """quant.e4m3_cap: the largest e4m3 value c with c * scale finite (448 unless scale is above
    2^119), rounded down onto e4m3's grid (0 for an Inf scale)."""
    lim = F32_MAX / scale
    lim = tl.where(lim > E4M3_MAX, E4M3_MAX, lim)
    lim_e = ((lim.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.exp2((tl.maximum(lim_e, -6) - 3).to(tl.float32))
    return tl.floor(lim / step) * step


@triton.jit
def _scale(amax, floor, POW2: tl.constexpr):
    """quant.scale_of: max(amax, floor) / 448, rounded up to a power of two with POW2 (powers
    of two, Inf and NaN as they are)."""
    scale = tl.where(amax < floor, floor, amax) / E4M3_MAX  # NaN stays NaN
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        expo = (bits >> 23) & 0xFF
        up = ((expo + 1) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(((bits & 0x7FFFFF) == 0) | (expo == 255), scale, up)
    return scale


@triton.jit
def _e4m3_code(v):
    """The e4m3 code (int32, sign included) of v, already clamped to +-cap; NaN -> 0x7F."""
    bits = v.to(tl.int32, bitcast=True)
    r = _e4m3_abs(v)
    rb = r.to(tl.int32, bitcast=True)
    r_e = ((rb >> 23) & 0xFF) - 127
    normal = ((r_e + 7) << 3) | ((rb >> 20) & 0x7)  # e4m3: bias 7, 3 mantissa bits
    sub = (r * 512.0).to(tl.int32)  # below 2^-6: multiples of 2^-9
    code = tl.where(r_e >= -6, normal, sub)
    return tl.where(v != v, 0x7F, code) | ((bits >> 24) & 0x80)  # NaN; the sign


@triton.jit
def _e4m3_value(v):
    """v (clamped to +-cap) rounded onto e4m3's grid, float32, sign kept; NaN stays NaN."""
    r = _e4m3_abs(v)
    r = (r.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(
        tl.float32, bitcast=True
    )
    return tl.where(v != v, v, r)


@triton.jit
def round_bf16(v):
    """float32 v rounded to nearest even on bf16's grid, still float32 (the GPU's cast; the
    interpreter's truncates); NaN stays NaN."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(v != v, v, r.to(tl.float32, bitcast=True))


@triton.jit
def _decode(code):
    """float32 of e4m3 codes given as integers (0x7F / 0xFF: NaN)."""
    c = code.to(tl.int32)
    e = (c >> 3) & 0xF
    m = (c & 0x7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _load(x_ptr, ids_ptr, xs_ptr, rows, cols, ok, row_ok, stride_xm, xs_nb, xs_block,
          DEQ: tl.constexpr, GATHER: tl.constexpr):  # fmt: skip
    """x's tile in float32: rows gathered through ids (GATHER), codes times their scales
    (DEQ: x is e4m3 codes given as uint8, xs the float32 scales, xs_nb per row, each for
    xs_block columns: 1 and K for row scales, K / 128 and 128 for 1 x 128 blocks)."""
    src = rows.to(tl.int64)
    if GATHER:
        src = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    x = tl.load(x_ptr + src[:, None] * stride_xm + cols[None, :], mask=ok, other=0)
    if DEQ:
        s = tl.load(xs_ptr + src[:, None] * xs_nb + cols[None, :] // xs_block, mask=ok, other=1.0)
        return _decode(x) * s
    return x.to(tl.float32)


@triton.jit
def _rows_part(
    pid, x_ptr, ids_ptr, xs_ptr, q_ptr, s_ptr, qv_ptr, M, K, stride_xm, xs_nb, xs_block, floor,
    POW2: tl.constexpr, DEQ: tl.constexpr, GATHER: tl.constexpr, ROW_VALUES: tl.constexpr,
    ROW_CODES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < K)
        x = _load(x_ptr, ids_ptr, xs_ptr, rows, cols, ok, row_ok, stride_xm, xs_nb, xs_block,
                  DEQ, GATHER)  # fmt: skip
        amax = _nan_max(amax, tl.reduce(tl.abs(x), 1, _nan_max))
    scale = _scale(amax, floor, POW2)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    cap = _cap(scale)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols[None, :] < K)
        x = _load(x_ptr, ids_ptr, xs_ptr, rows, cols, ok, row_ok, stride_xm, xs_nb, xs_block,
                  DEQ, GATHER)  # fmt: skip
        v = x / scale[:, None]
        c = cap[:, None]
        v = tl.where(v > c, c, tl.where(v < -c, -c, v))  # NaN stays NaN
        q = _e4m3_code(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)  # the bits as they are
        at = rows[:, None].to(tl.int64) * K + cols[None, :]
        if ROW_CODES:
            tl.store(q_ptr + at, q, mask=ok)
        if ROW_VALUES:  # also code x scale (exact in bf16 with POW2)
            y = _e4m3_value(v) * scale[:, None]
            tl.store(qv_ptr + at, y.to(qv_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _padded_start(ends_ptr, E, s, E_POW2: tl.constexpr):
    """Where row s, the first row of a group, lands in the padded layout the FP8 weight-gradient
    GEMM reads (moe/fp8/triton_wgrad_gemm.py): each of the E experts' rows (int32 ends) padded
    to a multiple of 16, so s moves by the padding of every expert ending at or before it."""
    es = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + es, mask=es < E, other=0)
    begins = tl.load(ends_ptr + es - 1, mask=(es > 0) & (es < E), other=0)
    pad = (16 - (ends - begins) % 16) % 16
    return s + tl.sum(tl.where((es < E) & (ends <= s), pad, 0), 0)


@triton.jit
def _cols_part(
    pid, x_ptr, ids_ptr, xs_ptr, qc_ptr, sc_ptr, offsets_ptr, pad_ptr, M, K, G, n_pad, stride_xm,
    xs_nb, xs_block, col_s1, col_s2, floor, POW2: tl.constexpr, DEQ: tl.constexpr,
    GATHER: tl.constexpr, PAD_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n_kb = tl.cdiv(K, BLOCK_K)
    g = pid // n_kb  # group g's rows, or (g == G) the tail rows past the last offset
    cols = (pid % n_kb) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    start = tl.load(offsets_ptr + tl.maximum(g - 1, 0)) * (g > 0).to(tl.int32)
    end = tl.load(offsets_ptr + tl.minimum(g, G - 1))
    end = tl.where(g < G, end, M)
    stop = end  # the rows written
    shift = 0  # row r written at r + shift
    if PAD_POW2 > 0:  # the padded layout: the group's rows then zeros to a multiple of 16
        end = tl.where(g < G, end, start)  # the tail rows: neither read nor written
        stop = start + (end - start + 15) // 16 * 16
        shift = _padded_start(pad_ptr, n_pad, start, PAD_POW2) - start
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        ok = row_ok[:, None] & col_ok[None, :]
        x = _load(x_ptr, ids_ptr, xs_ptr, rows, cols, ok, row_ok, stride_xm, xs_nb, xs_block,
                  DEQ, GATHER)  # fmt: skip
        amax = _nan_max(amax, tl.reduce(tl.abs(x), 0, _nan_max))
    scale = _scale(amax, floor, POW2)
    tl.store(sc_ptr + g * K + cols, scale, mask=cols < tl.where(g < G, K, 0))  # not the tail's
    cap = _cap(scale)
    for r0 in range(start, stop, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        ok = row_ok[:, None] & col_ok[None, :]
        x = _load(x_ptr, ids_ptr, xs_ptr, rows, cols, ok, row_ok, stride_xm, xs_nb, xs_block,
                  DEQ, GATHER)  # fmt: skip
        v = x / scale[None, :]
        c = cap[None, :]
        v = tl.where(v > c, c, tl.where(v < -c, -c, v))
        # the codes into the transposed copy: (row, col) at row + shift + col * s1 + g * s2
        code = tl.where((g < G) & row_ok[:, None], _e4m3_code(v), 0)
        out = qc_ptr + (rows[:, None].to(tl.int64) + shift) + cols[None, :].to(tl.int64) * col_s1
        out += g.to(tl.int64) * col_s2
        at = (rows < stop)[:, None] & col_ok[None, :]
        tl.store(out, code.to(tl.uint8).to(tl.float8e4nv, bitcast=True), mask=at)


@triton.jit
def _quant_kernel(
    x_ptr, ids_ptr, xs_ptr, q_ptr, s_ptr, qv_ptr, qc_ptr, sc_ptr, offsets_ptr, pad_ptr,
    M, K, G, n_pad, stride_xm, xs_nb, xs_block, col_s1, col_s2, n_row_programs, floor,
    POW2: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, ROW_VALUES: tl.constexpr, ROW_CODES: tl.constexpr, DEQ: tl.constexpr, GATHER: tl.constexpr,
    PAD_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CBLOCK_M: tl.constexpr, CBLOCK_K: tl.constexpr,
):  # fmt: skip
    """Programs [0, n_row_programs): row blocks (ROWS); the rest: (group, column block) tiles
    (COLS)."""
    pid = tl.program_id(0)
    if ROWS and COLS:
        if pid < n_row_programs:
            _rows_part(pid, x_ptr, ids_ptr, xs_ptr, q_ptr, s_ptr, qv_ptr, M, K, stride_xm, xs_nb,
                       xs_block, floor, POW2, DEQ, GATHER, ROW_VALUES, ROW_CODES, BLOCK_M, BLOCK_K)  # fmt: skip
        else:
            _cols_part(pid - n_row_programs, x_ptr, ids_ptr, xs_ptr, qc_ptr, sc_ptr, offsets_ptr,
                       pad_ptr, M, K, G, n_pad, stride_xm, xs_nb, xs_block, col_s1, col_s2, floor,
                       POW2, DEQ, GATHER, PAD_POW2, CBLOCK_M, CBLOCK_K)  # fmt: skip
    elif ROWS:
        _rows_part(pid, x_ptr, ids_ptr, xs_ptr, q_ptr, s_ptr, qv_ptr, M, K, stride_xm, xs_nb,
                   xs_block, floor, POW2, DEQ, GATHER, ROW_VALUES, ROW_CODES, BLOCK_M, BLOCK_K)  # fmt: skip
    else:
        _cols_part(pid, x_ptr, ids_ptr, xs_ptr, qc_ptr, sc_ptr, offsets_ptr, pad_ptr, M, K, G,
                   n_pad, stride_xm, xs_nb, xs_block, col_s1, col_s2, floor, POW2, DEQ, GATHER,
                   PAD_POW2, CBLOCK_M, CBLOCK_K)  # fmt: skip


ROW_BLOCK_M, COL_BLOCK_M = 4, 32  # rows per program: row blocks; the column tiles' row step


def _row_block_k(K: int) -> int:
    return min(512, triton.next_power_of_2(max(K, 16)))


def _col_block_k(K: int) -> int:
    return min(128, triton.next_power_of_2(max(K, 16)))


def quantize(
    x: torch.Tensor,
    pow2: bool,
    floor: float,
    *,
    rows: bool = True,
    groups: torch.Tensor | None = None,
    transposed: tuple[int, int, tuple] | None = None,
    ids: torch.Tensor | None = None,
    row_scales: torch.Tensor | None = None,
    row_values: torch.dtype | None = None,
    scale_block: int | None = None,
    row_codes: bool = True,
    padded: torch.Tensor | None = None,
):
    """One launch: (q, s) the row-wise codes and scales (rows=True), and (qc, sc) the columns
    scaled within the groups of rows ending at `groups` (int32 cumulative ends; rows past the
    last end are the tail): qc the codes in the transposed copy (default [K, M], tail rows zero;
    `transposed`
    = (s1, s2, shape) places (row, col) of group g at row + col * s1 + g * s2 of a buffer of
    that shape; `padded` = the E experts' int32 row ends: the FP8 weight-gradient GEMM's layout
    [K, 16 * (ceil(M / 16) + E)], each expert's rows from a 16-aligned start, zeros up to the
    next multiple of 16, no tail rows: moe/fp8/triton_wgrad_gemm.py) and sc [G, K] the scales.
    Absent parts are None.

    x [N, K] with unit column stride, or contiguous [..., K] (its rows; q takes x's shape);
    ids [M]: x's rows read at ids (else M = N); row_scales [N, nb]: x holds e4m3 codes
    (float8_e4m3fn or their uint8 view) with these scales (one per row, or per 1 x K / nb
    block of scale_block columns, default K / nb). row_values a dtype: the row-wise part also
    writes its dequantized values in it, returned as a fifth result (row_codes=False: the
    values only, q None)."""
    K = x.shape[-1]
    shape = x.shape if ids is None else (ids.shape[0], K)
    x = x if x.dim() == 2 else x.view(math.prod(x.shape[:-1]), K)
    M = ids.shape[0] if ids is not None else x.shape[0]
    dev = x.device
    q = s = qc = sc = qv = None
    if rows:
        if row_codes or row_values is None:
            q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=dev)
        s = torch.empty((M, 1), dtype=torch.float32, device=dev)
        if row_values is not None:
            qv = torch.empty(shape, dtype=row_values, device=dev)
    G = 0 if groups is None else groups.shape[0]
    if groups is not None:
        sc = torch.empty((G, K), dtype=torch.float32, device=dev)
        qc_shape = transposed[2] if transposed is not None else (K, M)
        if padded is not None:
            qc_shape = (K, 16 * (triton.cdiv(M, 16) + padded.shape[0]))
        qc = torch.empty(qc_shape, dtype=torch.float8_e4m3fn, device=dev)
    if M == 0 or K == 0 or (groups is not None and G == 0):  # (no groups: all rows the tail)
        if qc is not None:
            qc.zero_()
        if rows and M and K:
            q, s, *_, qv = quantize(x, pow2, floor, ids=ids, row_scales=row_scales,
                                    row_values=row_values, row_codes=row_codes)  # fmt: skip
        return _results(q, s, qc, sc, qv)
    s1, s2 = transposed[:2] if transposed is not None else (M, 0)
    n_pad = 0 if padded is None else padded.shape[0]
    if n_pad:
        s1 = qc.shape[1]
    n_rows = triton.cdiv(M, ROW_BLOCK_M) if rows else 0
    n_cols = (G + 1) * triton.cdiv(K, _col_block_k(K)) if groups is not None else 0
    x_in = x.detach().view(torch.uint8) if row_scales is not None else x.detach()
    xs_nb = row_scales.shape[-1] if row_scales is not None else 1
    dummy = s if s is not None else sc
    _quant_kernel[(n_rows + n_cols,)](
        x_in, ids if ids is not None else dummy, row_scales if row_scales is not None else dummy,
        q if q is not None else dummy, s if s is not None else dummy,
        qv if qv is not None else dummy, qc if n_cols else dummy, sc if sc is not None else dummy,
        groups if n_cols else dummy, padded if n_pad else dummy, M, K, G, n_pad, x.stride(0),
        xs_nb, scale_block or triton.cdiv(K, xs_nb), s1, s2, n_rows, float(floor), POW2=pow2,
        ROWS=rows, COLS=bool(n_cols), PAD_POW2=triton.next_power_of_2(n_pad) if n_pad else 0,
        ROW_VALUES=qv is not None, ROW_CODES=q is not None, DEQ=row_scales is not None,
        GATHER=ids is not None, BLOCK_M=ROW_BLOCK_M, BLOCK_K=_row_block_k(K),
        CBLOCK_M=COL_BLOCK_M, CBLOCK_K=_col_block_k(K),
    )  # fmt: skip
    return _results(q, s, qc, sc, qv)


def _results(q, s, qc, sc, qv) -> tuple:
    """(q, s, qc, sc), and qv when row values were asked for."""
    return (q, s, qc, sc) if qv is None else (q, s, qc, sc, qv)


def quantize_rows_triton(x: torch.Tensor, pow2: bool, floor: float):
    """(q e4m3 like x, scales float32 [..., 1]) = quant.quantize_along(x, -1, pow2, floor), in
    one launch. x: rows along its last dim with unit stride, 2-D or contiguous; float32, bf16
    or fp16."""
    q, s, _, _ = quantize(x, pow2, floor)
    return q, s.view(*x.shape[:-1], 1)
