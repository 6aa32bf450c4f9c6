"""Ragged-rows grouped GEMM: out[rows of e] = epilogue(A[rows of e] @ B[e]), all experts, one launch.

One kernel, four roles in the expert MLP (constexpr flags pick the code at compile time):
  up     EPILOGUE=1: A rows gathered from x through idx_M (the experts' gather_ids_R: no permuted
         copy), B = w1 (and w3 for swiglu, sharing the A tiles: two accumulators), + b1, fused
         activation; optionally stores the pre-activation (h, and g for swiglu) for the backward.
  down   EPILOGUE=0: A = act, B = w2, + b2.
  dact   EPILOGUE=2: A = dout, B = w2^T (a strided view), epilogue = activation backward using
         the saved pre-activation: writes dh (and dg), and optionally s * act(pre) (dW2's
         operand, from the pre tiles already loaded: no recompute pass).
  dx     EPILOGUE=0: A = [dh | dg], B = w1^T (+ w3^T: a second K loop into the same accumulator).
The row-tile -> expert map comes from `schedule.expert_tile` (on device, no host sync);
tail rows (dropped pairs, >= offsets[-1]) are written as exact zeros by the tail tiles. Pointer
arithmetic is int64, so M*K, E*K*N may exceed 2**31. Any K, N >= 1 (masked loads); K, N that
are multiples of 16 (8 for 2-byte types with 16-byte rows) are the fast case on GPUs.

The sm_90 path (USE_TMA; opt-in with MOE_TRITON_TMA=1 until it has passed the suite on a GPU)
loads weight tiles and contiguous A tiles through tensor descriptors built on the device and
runs a persistent grid (one program per SM striding over the tiles in the grouped order).
The pointer path stays for older GPUs, unaligned shapes and the default.
"""

import torch
import triton
import triton.language as tl

from moe.kernels.triton import lang as tlx
from moe.kernels.triton.activations import act_bwd, act_fwd
from moe.kernels.triton.common import (
    autotune_prune,
    dot_flags,
    e_pow2,
    interpreting,
    m_bucket,
    tile_configs,
)
from moe.kernels.triton.mma import mma
from moe.kernels.triton.schedule import expert_tile, grouped_tile, max_row_tiles
from moe.kernels.triton.tma import ensure_allocator, persistent_programs, tma_default, tma_ok

EPI_PLAIN, EPI_ACT, EPI_ACT_BWD = 0, 1, 2


def _configs() -> list[triton.Config]:
    # rows: the tile sizes (in the names' order), num_warps, num_stages
    table = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4)]
    table += [(128, 64, 64, 8, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 64, 64, 8, 4)]
    return tile_configs(("BLOCK_M", "BLOCK_N", "BLOCK_K"), table)


def _prune(configs, named_args, **kwargs):
    """Fit registers and shared memory. Activation epilogues (up, dact) keep at most 64 fp32
    tile elements per thread: one accumulator, or for SwiGLU two (up: h and g; dact: the
    accumulator beside the loaded h and g; one more with SAVE_ACT: for SwiGLU 64x64 on 8 warps
    is then what sm_90 compiles without spills); so does SwiGLU's dx (two K loops: triton 3.6
    spills 128x128 on 4 warps). More spills on sm_90: tools/triton_aot_check.py compiles every
    kept config and fails on any stack byte. 4-byte (fp32) operands take half the K step."""
    wide = named_args["a_ptr"].element_size() == 4
    act_epilogue = kwargs.get("EPILOGUE") in (EPI_ACT, EPI_ACT_BWD)
    tiles = (2 if act_epilogue and kwargs.get("GATED") else 1) + bool(kwargs.get("SAVE_ACT"))
    two_loops = kwargs.get("EPILOGUE") == EPI_PLAIN and kwargs.get("GATED")  # dx of SwiGLU
    kept = []
    for c in configs:
        per_thread = c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] // (32 * c.num_warps)
        if (act_epilogue or two_loops) and per_thread * tiles > 64:
            continue
        if wide:
            meta = dict(c.kwargs, BLOCK_K=c.kwargs["BLOCK_K"] // 2)
            c = triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages)
        kept.append(c)
    return kept or configs[-1:]


@triton.jit
def weight_desc(ptr, E, K, N, stride_be, stride_bk, stride_bn, B_T: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """TMA descriptor of the [E, K, N] weights; B_T: the memory is [E, N, K] (a w^T view)."""
    if B_T:
        desc = tl.make_tensor_descriptor(
            ptr,
            shape=[E, N, K],
            strides=[stride_be, stride_bn, 1],
            block_shape=[1, BLOCK_N, BLOCK_K],
        )
    else:
        desc = tl.make_tensor_descriptor(
            ptr,
            shape=[E, K, N],
            strides=[stride_be, stride_bk, 1],
            block_shape=[1, BLOCK_K, BLOCK_N],
        )
    return desc


@triton.jit
def weight_tile(desc, e, k0, n0, B_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] weight tile of expert e at (k0, n0)."""
    if B_T:
        tile = tl.trans(desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K))
    else:
        tile = desc.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    return tile


@triton.jit
def _a_tile(a_ptrs, live, k_ok, EVEN_K: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of the rows: rows not live and (unless EVEN_K) columns past K
    read as 0."""
    if EVEN_K:
        return tl.load(a_ptrs, mask=live[:, None], other=0.0)
    return tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _b_tile(b_ptrs, n_ok, k_ok, EVEN_K: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile: columns past N and (unless EVEN_K) rows past K read
    as 0."""
    if EVEN_K:
        return tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
    return tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _rows_tile(
    pid, a_desc, a2_desc, b_desc, b2_desc, a_ptr, idx_ptr, b_ptr, b2_ptr, bias_ptr, pre_ptr, out_ptr, offsets_ptr,
    scale_ptr, rowdot_ptr, act_ptr, M, N, K, E, M_BUCKET,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_biase, stride_pm, stride_om,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, GATHER: tl.constexpr,
    HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr, ROW_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr, E_POW2: tl.constexpr, EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr, B_T: tl.constexpr, SAVE_ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One output tile (virtual row tile x column tile) of the ragged-rows GEMM."""
    pid_m, pid_n = grouped_tile(pid, M, N, E, BLOCK_M, BLOCK_N, GROUP_M)

    seg, row0, seg_end = expert_tile(pid_m, offsets_ptr, E, M, BLOCK_M, E_POW2)
    if seg <= E:  # else: a virtual tile past the real ones
        is_expert = seg < E
        # Vector compares only (the interpreter mistypes vector & scalar-bool masks).
        offs_m = row0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seg_end
        live = offs_m < tl.where(is_expert, seg_end, 0)  # rows read: none in the tail segment
        rows = offs_m.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        e64 = tl.minimum(seg, E - 1).to(tl.int64)

        if GATHER:
            src = tl.load(idx_ptr + rows, mask=live, other=0).to(tl.int64)
        else:
            src = rows
        a_ptrs = a_ptr + src[:, None] * stride_am + offs_k[None, :] * stride_ak
        k64, n64 = offs_k.to(tl.int64), offs_n.to(tl.int64)
        b_off = e64 * stride_be + k64[:, None] * stride_bk + n64[None, :] * stride_bn
        b_ptrs = b_ptr + b_off
        b2_ptrs = b2_ptr + b_off
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        acc2 = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        num_k = tl.where(is_expert, tlx.cdiv(K, BLOCK_K), 0)  # tail tiles skip the loop: zeros
        if USE_TMA:
            # TMA (sm_90): the descriptors come from the kernel (built once per program).
            e32 = tl.minimum(seg, E - 1)
            n0 = pid_n * BLOCK_N
            for kk in range(0, num_k):
                if GATHER:
                    a = tl.load(
                        a_ptrs, mask=live[:, None] & (offs_k < K - kk * BLOCK_K)[None, :], other=0.0
                    )
                else:
                    a = a_desc.load([row0, kk * BLOCK_K])
                acc = mma(
                    a,
                    weight_tile(b_desc, e32, kk * BLOCK_K, n0, B_T, BLOCK_K, BLOCK_N),
                    acc,
                    DOT_F32,
                    PRECISION,
                )
                if GATED and EPILOGUE == 1:
                    b2 = weight_tile(b2_desc, e32, kk * BLOCK_K, n0, B_T, BLOCK_K, BLOCK_N)
                    acc2 = mma(a, b2, acc2, DOT_F32, PRECISION)
                a_ptrs += BLOCK_K * stride_ak
            if GATED and EPILOGUE == 0:
                for kk in range(0, num_k):
                    a = a2_desc.load([row0, kk * BLOCK_K])
                    b2 = weight_tile(b2_desc, e32, kk * BLOCK_K, n0, B_T, BLOCK_K, BLOCK_N)
                    acc = mma(a, b2, acc, DOT_F32, PRECISION)
        else:
            for kk in range(0, num_k):
                k_ok = offs_k < K - kk * BLOCK_K
                a = _a_tile(a_ptrs, live, k_ok, EVEN_K)
                acc = mma(a, _b_tile(b_ptrs, n_ok, k_ok, EVEN_K), acc, DOT_F32, PRECISION)
                if GATED and EPILOGUE == 1:
                    b2 = _b_tile(b2_ptrs, n_ok, k_ok, EVEN_K)
                    acc2 = mma(a, b2, acc2, DOT_F32, PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
                b2_ptrs += BLOCK_K * stride_bk
            if GATED and EPILOGUE == 0:
                # dx for swiglu: A is [dh | dg] (2K columns); the second half pairs with B2 = w3^T.
                a_ptrs = a_ptr + src[:, None] * stride_am + (K + offs_k)[None, :] * stride_ak
                b2_ptrs = b2_ptr + b_off
                for kk in range(0, num_k):
                    k_ok = offs_k < K - kk * BLOCK_K
                    a = _a_tile(a_ptrs, live, k_ok, EVEN_K)
                    acc = mma(a, _b_tile(b2_ptrs, n_ok, k_ok, EVEN_K), acc, DOT_F32, PRECISION)
                    a_ptrs += BLOCK_K * stride_ak
                    b2_ptrs += BLOCK_K * stride_bk

        scale = tl.full([BLOCK_M], 1.0, tl.float32)
        if ROW_SCALE:
            scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias_ok = offs_n < tl.where(is_expert, N, 0)
            bias = tl.load(bias_ptr + e64 * stride_biase + offs_n, mask=bias_ok, other=0.0)
            if ROW_SCALE and EPILOGUE == 0:  # down: the scaled rows' bias is scaled too
                acc += bias.to(tl.float32)[None, :] * scale[:, None]
            else:
                acc += bias.to(tl.float32)[None, :]
        out_mask = row_ok[:, None] & n_ok[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        out_ty = out_ptr.dtype.element_ty
        if EPILOGUE == 0:
            tl.store(out_ptrs, acc.to(out_ty), mask=out_mask)
        elif EPILOGUE == 1:
            if SAVE_PRE:
                pre_ptrs = pre_ptr + rows[:, None] * stride_pm + offs_n[None, :]
                tl.store(pre_ptrs, acc.to(out_ty), mask=out_mask)
                if GATED:
                    tl.store(pre_ptrs + N, acc2.to(out_ty), mask=out_mask)
            y = act_fwd(acc, acc2, ACT)
            if ROW_SCALE:
                y = y * scale[:, None]
            tl.store(out_ptrs, y.to(out_ty), mask=out_mask)
        else:
            pre_ptrs = pre_ptr + rows[:, None] * stride_pm + offs_n[None, :]
            pre_mask = live[:, None] & n_ok[None, :]
            h = tl.load(pre_ptrs, mask=pre_mask, other=0.0).to(tl.float32)
            g = h
            if GATED:
                g = tl.load(pre_ptrs + N, mask=pre_mask, other=0.0).to(tl.float32)
            a = act_fwd(h, g, ACT)
            if SAVE_ACT:  # s * act(pre), what GEMM2 read: dW2's operand (rows not live: 0)
                sa = tl.where(live[:, None], a * scale[:, None] if ROW_SCALE else a, 0.0)
                tl.store(act_ptr + rows[:, None] * N + offs_n[None, :], sa.to(out_ty), out_mask)
            if ROW_SCALE:  # acc = dL/d(scale * act): this N tile's part of dL/d scale, then d act
                # one partial per 16 columns: the same sums whatever BLOCK_N the autotuner picks
                prod = tl.reshape(acc * a, [BLOCK_M, BLOCK_N // 16, 16])
                slot = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
                slot_ptrs = rowdot_ptr + slot.to(tl.int64)[None, :] * M + rows[:, None]
                slot_ok = row_ok[:, None] & (slot * 16 < N)[None, :]
                tl.store(slot_ptrs, tlx.vsum(prod, 2), mask=slot_ok)
                acc = acc * scale[:, None]
            dh, dg = act_bwd(acc, h, g, ACT)
            tl.store(out_ptrs, dh.to(out_ty), mask=out_mask)
            if GATED:
                tl.store(out_ptrs + N, dg.to(out_ty), mask=out_mask)


@triton.autotune(
    configs=_configs(),
    key=["E", "N", "K", "M_BUCKET", "EPILOGUE", "GATED", "GATHER", "USE_TMA", "B_T", "SAVE_ACT"],
    prune_configs_by={"early_config_prune": autotune_prune(_prune)},
)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _ragged_rows_kernel(
    a_ptr, idx_ptr, b_ptr, b2_ptr, bias_ptr, pre_ptr, out_ptr, offsets_ptr, scale_ptr, rowdot_ptr,
    M, N, K, E, M_BUCKET,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_biase, stride_pm, stride_om,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, GATHER: tl.constexpr,
    HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr, ROW_SCALE: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr, E_POW2: tl.constexpr, EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr, B_T: tl.constexpr, NUM_PROGS, act_ptr, SAVE_ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    if USE_TMA:
        # The sm_90 path: TMA descriptors built on the device, once per program; reads past
        # K / N / M are zero-filled. Weights: one 3D descriptor [E, K, N] ([E, N, K] for the w^T
        # views, B_T), so a tile never crosses into the next expert. Contiguous A rows: [M, K]
        # (for dx, one per half of [dh | dg]); a last row tile may read the next expert's rows,
        # whose outputs are never stored. Gathered A rows load through pointers.
        b_desc = weight_desc(b_ptr, E, K, N, stride_be, stride_bk, stride_bn, B_T, BLOCK_K, BLOCK_N)
        b2_desc = weight_desc(
            b2_ptr, E, K, N, stride_be, stride_bk, stride_bn, B_T, BLOCK_K, BLOCK_N
        )
        if GATHER:
            a_desc = b_desc  # unused
            a2_desc = b_desc
        else:
            a_desc = tl.make_tensor_descriptor(
                a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K]
            )
            if GATED and EPILOGUE == 0:
                a2_desc = tl.make_tensor_descriptor(
                    a_ptr + K, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K]
                )
            else:
                a2_desc = a_desc  # unused
        # Persistent: NUM_PROGS programs (one per SM) stride over the tiles in grouped order.
        total = (tlx.cdiv(M, BLOCK_M) + E) * tlx.cdiv(N, BLOCK_N)
        for pid in range(tl.program_id(0), total, NUM_PROGS):
            _rows_tile(pid, a_desc, a2_desc, b_desc, b2_desc, a_ptr, idx_ptr, b_ptr, b2_ptr, bias_ptr, pre_ptr, out_ptr, offsets_ptr, scale_ptr, rowdot_ptr, act_ptr, M, N, K, E,
                M_BUCKET, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_biase,
                stride_pm, stride_om, EPILOGUE, ACT, GATED, GATHER, HAS_BIAS, SAVE_PRE, ROW_SCALE, DOT_F32,
                PRECISION, E_POW2, EVEN_K, USE_TMA, B_T, SAVE_ACT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)  # fmt: skip
    else:  # the descriptor slots are unused
        _rows_tile(tl.program_id(0), a_ptr, a_ptr, a_ptr, a_ptr, a_ptr, idx_ptr, b_ptr, b2_ptr, bias_ptr, pre_ptr, out_ptr, offsets_ptr, scale_ptr, rowdot_ptr, act_ptr, M, N, K, E,
            M_BUCKET, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_biase,
            stride_pm, stride_om, EPILOGUE, ACT, GATED, GATHER, HAS_BIAS, SAVE_PRE, ROW_SCALE, DOT_F32,
            PRECISION, E_POW2, EVEN_K, USE_TMA, B_T, SAVE_ACT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)  # fmt: skip


def ragged_mm(
    a_MK: torch.Tensor,
    b_EKN: torch.Tensor,
    offsets_E: torch.Tensor,
    out: torch.Tensor,
    *,
    epilogue: int = EPI_PLAIN,
    act: int = 0,
    b2_EKN: torch.Tensor | None = None,
    bias_EN: torch.Tensor | None = None,
    idx_M: torch.Tensor | None = None,
    pre: torch.Tensor | None = None,
    save_pre: bool = False,
    gated: bool = False,
    tma: bool | None = None,
    row_scale_M: torch.Tensor | None = None,
    rowdot_NM: torch.Tensor | None = None,
    act_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the ragged-rows kernel; `out` has one row per expert row (M = out.shape[0]).

    a_MK is read at row idx_M[m] when idx_M is given (gather on load). With b2_EKN: up role
    (EPILOGUE=1) -> second accumulator; dx role (EPILOGUE=0) -> A has 2K columns, second half
    times b2. `gated` (swiglu): the up/dx roles need b2; the dact role (EPILOGUE=2) reads h and g
    from `pre` ([M, 2N]) and writes dh, dg into `out` ([M, 2N]). b_EKN / b2_EKN may be strided
    views (w^T). `out` and `pre` need unit column stride. Returns `out`.
    tma: load weight tiles (and contiguous A tiles) through tensor descriptors. Default: off
    unless MOE_TRITON_TMA=1 on an sm_90+ GPU (not yet run on a GPU; the interpreter runs it);
    used only where TMA's 16-byte alignment holds.

    row_scale_M (fp32 [M], the combine weights folded into the experts) scales row m: up role
    -> act * s (pre stays unscaled); plain role -> the bias is scaled (A rows already are);
    dact role -> acc = dL/d(s * act) is scaled by s before the activation backward, and each
    program stores <acc, act> over each 16 columns of its tile into rowdot_NM[n // 16, m] (fp32
    [cdiv(N, 16), M]; summed over its first dim it is dL/ds: no atomics, and the same partial
    sums whatever tile the autotuner picks). act_out (dact role, contiguous [M, N]): also
    written, s * act(pre) (zero on rows not live), the operand GEMM2 read, for dW2.
    """
    M, E = out.shape[0], offsets_E.shape[0]
    K, N = b_EKN.shape[1], b_EKN.shape[2]
    if M == 0 or N == 0:
        return out
    if gated and epilogue != EPI_ACT_BWD:
        assert b2_EKN is not None and b2_EKN.shape == b_EKN.shape
        assert b2_EKN.stride() == b_EKN.stride()
    assert out.stride(1) == 1 and (pre is None or pre.stride(1) == 1)
    dot_f32, precision = dot_flags(a_MK.dtype)
    pre_t = pre if pre is not None else out
    if epilogue == EPI_ACT_BWD and row_scale_M is not None:
        assert rowdot_NM is not None and rowdot_NM.shape == (triton.cdiv(N, 16), M)
    if act_out is not None:  # the dact role's second output
        assert (epilogue, act_out.shape, act_out.stride()) == (EPI_ACT_BWD, (M, N), (N, 1))
    b_t = b_EKN.stride(2) != 1
    use_tma = tma_ok(a_MK, b_EKN, b2_EKN, K, gated and epilogue == EPI_PLAIN, idx_M is not None)
    use_tma = use_tma and (tma_default(a_MK.device) if tma is None else tma)
    if use_tma and not interpreting():
        ensure_allocator()
    num_progs = persistent_programs(a_MK.device)

    def grid(meta):
        tiles = max_row_tiles(M, E, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(tiles, num_progs),) if use_tma else (tiles,)

    _ragged_rows_kernel[grid](
        a_MK, idx_M if idx_M is not None else offsets_E, b_EKN,
        b2_EKN if b2_EKN is not None else b_EKN, bias_EN if bias_EN is not None else b_EKN,
        pre_t, out, offsets_E, row_scale_M if row_scale_M is not None else out,
        rowdot_NM if rowdot_NM is not None else out,
        M, N, K, E, m_bucket(M),
        a_MK.stride(0), a_MK.stride(1), b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
        bias_EN.stride(0) if bias_EN is not None else 0, pre_t.stride(0), out.stride(0),
        EPILOGUE=epilogue, ACT=act, GATED=gated, GATHER=idx_M is not None,
        HAS_BIAS=bias_EN is not None, SAVE_PRE=save_pre, ROW_SCALE=row_scale_M is not None,
        DOT_F32=dot_f32, PRECISION=precision, E_POW2=e_pow2(E), GROUP_M=8, USE_TMA=use_tma, B_T=b_t, NUM_PROGS=num_progs,
        act_ptr=act_out if act_out is not None else out, SAVE_ACT=act_out is not None,
    )  # fmt: skip
    return out
