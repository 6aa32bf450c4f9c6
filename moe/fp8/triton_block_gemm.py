"""The blockwise recipe's forward and dgrad grouped GEMM on e4m3 codes and their block scales
(DeepSeek-V3's scaling, issue 61), one Triton launch for all experts, as the custom op
`moe::fp8_block_mm`:

    out[rows of e] = sum over K blocks kb of 128 of
                     (a[rows, kb] @ b[e, kb, n]) * a_scale[rows, kb] * b_scale[e, kb, n // 128]

a: codes [M, K] with one scale per 1 x 128 block [M, K / 128]; b: codes [E, K, N] (any strides:
the dgrad passes w^T as a view) with one scale per 128 x 128 block [E, K / 128, N / 128]. Each
128-wide K block is one e4m3 tl.dot (tensor cores, float32 accumulator) whose result is scaled
and added to a float32 sum (DeepGEMM's promotion: the tensor cores' partial sums never span more
than one block). An output tile is at most 128 wide, so it sits inside one weight block.
Rows are ragged by the int32 cumulative offsets (schedule.expert_tile: no host sync); rows past
offsets[-1] come out zero. K and N multiples of 128.

e4m3 x e4m3 products are exact in float32, so the result is the float32 grouped GEMM of the
dequantized operands up to the order of the sums. One kernel serves the GPU and Triton's
interpreter; under the interpreter (whose float8 reads e4m3's NaN code as a number and whose
float32 -> bf16 cast truncates) the codes are decoded to float32 before the same tl.dot
(DECODE: the same exact products) and bf16 outputs rounded to nearest first (RNE_BF16).
"""

import torch
import triton
import triton.language as tl

from moe.fp8.triton_quant import _decode, round_bf16
from moe.kernels.triton.common import autotune_prune, e_pow2, interpreting, m_bucket
from moe.kernels.triton.schedule import expert_tile, grouped_tile, max_row_tiles

BLOCK = 128  # the scaling block along K (and the weight's along N)


def _configs() -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K is the scaling block."""
    table = [(128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 3)]
    if interpreting():
        table = [(16, 128, 4, 1)]  # (numpy's float32 dot sums in an order set by its N: as
        # moe/fp8/triton_swiglu_mm.py's, so the two give the same bits here too)
    return [
        triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=BLOCK, GROUP_M=8), num_warps=w,
                      num_stages=s)
        for m, n, w, s in table
    ]  # fmt: skip


@triton.jit
def _k_blocks(acc, a_ptr, as_ptr, b_ptr, bs_ptr, rows, live, e64, pid_n, num_k,
              stride_am, stride_asm, stride_ask, stride_be, stride_bk, stride_bn,
              stride_se, stride_sk, stride_sn,
              DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + the sum over num_k K blocks of (a[rows, kb] @ b[e, kb, n]) x a_scale x b_scale."""
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    n64 = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + e64 * stride_be + offs_k[:, None] * stride_bk + n64[None, :] * stride_bn
    as_ptrs = as_ptr + rows * stride_asm
    bs_ptr = bs_ptr + e64 * stride_se + (pid_n * BLOCK_N // BLOCK_K) * stride_sn
    # the scales are read one K block ahead (Triton's pipeliner stages only the dot's
    # operands): their latency hides behind the previous block's MMA
    s = tl.load(as_ptrs, mask=live, other=0.0) * tl.load(bs_ptr)
    for kb in range(0, num_k):
        a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
        b = tl.load(b_ptrs)
        if DECODE:  # the interpreter reads e4m3's NaN code (0x7F) as a number
            a = _decode(a.to(tl.uint8, bitcast=True))
            b = _decode(b.to(tl.uint8, bitcast=True))
        nxt = tl.minimum(kb + 1, num_k - 1)  # (the last block's again after the last)
        a_s = tl.load(as_ptrs + nxt * stride_ask, mask=live, other=0.0)
        b_s = tl.load(bs_ptr + nxt * stride_sk)
        acc += tl.dot(a, b) * s[:, None]
        s = a_s * b_s
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def tile_rows(seg, row0, seg_end, K, E, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """An expert_tile's (rows int64, rows written, rows read: none in the tail segment, expert
    int64, K blocks: 0 in the tail, whose tiles write zeros)."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    live = offs_m < tl.where(seg < E, seg_end, 0)
    num_k = tl.where(seg < E, K // BLOCK_K, 0)
    e64 = tl.minimum(seg, E - 1).to(tl.int64)
    return offs_m.to(tl.int64), offs_m < seg_end, live, e64, num_k


@triton.autotune(
    configs=_configs(),
    key=["N", "K", "E", "M_BUCKET", "stride_bk", "TWO"],
    prune_configs_by={"early_config_prune": autotune_prune()},
)
@triton.jit
def _block_mm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, offsets_ptr,
    M, N, K, E, M_BUCKET,
    stride_am, stride_asm, stride_ask, stride_be, stride_bk, stride_bn,
    stride_se, stride_sk, stride_sn, a2_ptr, as2_ptr, b2_ptr, bs2_ptr,
    E_POW2: tl.constexpr, TWO: tl.constexpr, DECODE: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One output tile (virtual row tile x column tile); TWO: + a2 @ b2 (the same shapes and
    strides) into the same sum. b's K or N stride is 1 (the JIT specialises a stride of 1: a K
    stride of 1 is the layout Hopper's e4m3 wgmma reads)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, E, BLOCK_M, BLOCK_N, GROUP_M)

    seg, row0, seg_end = expert_tile(pid_m, offsets_ptr, E, M, BLOCK_M, E_POW2)
    if seg <= E:  # else: a virtual tile past the real ones
        rows, row_ok, live, e64, num_k = tile_rows(seg, row0, seg_end, K, E, BLOCK_M, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc = _k_blocks(acc, a_ptr, as_ptr, b_ptr, bs_ptr, rows, live, e64, pid_n, num_k,
                        stride_am, stride_asm, stride_ask, stride_be, stride_bk, stride_bn,
                        stride_se, stride_sk, stride_sn, DECODE, BLOCK_N, BLOCK_K)  # fmt: skip
        if TWO:
            acc = _k_blocks(acc, a2_ptr, as2_ptr, b2_ptr, bs2_ptr, rows, live, e64, pid_n, num_k,
                            stride_am, stride_asm, stride_ask, stride_be, stride_bk, stride_bn,
                            stride_se, stride_sk, stride_sn, DECODE, BLOCK_N, BLOCK_K)  # fmt: skip
        if RNE_BF16:  # the interpreter's float32 -> bf16 truncates: round to nearest even first
            acc = round_bf16(acc)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows[:, None] * N + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def check(q_MK, s_MB, q_EKN, s_EKN, offsets_E) -> None:
    """One ValueError naming what block_mm cannot take."""
    (M, K), (E, K2, N) = q_MK.shape, q_EKN.shape
    if K2 != K or K % BLOCK or N % BLOCK:
        raise ValueError(
            f"fp8_block_mm needs a [M, K] and b [E, K, N] with K, N multiples of {BLOCK}, got "
            f"{tuple(q_MK.shape)} and {tuple(q_EKN.shape)}"
        )
    if s_MB.shape != (M, K // BLOCK) or s_EKN.shape != (E, K // BLOCK, N // BLOCK):
        raise ValueError(
            f"fp8_block_mm: scales {tuple(s_MB.shape)}, {tuple(s_EKN.shape)} do not fit codes "
            f"{tuple(q_MK.shape)}, {tuple(q_EKN.shape)} in blocks of {BLOCK}"
        )
    if s_MB.dtype != torch.float32 or s_EKN.dtype != torch.float32:
        raise ValueError(f"fp8_block_mm needs float32 scales, got {s_MB.dtype}, {s_EKN.dtype}")
    if offsets_E.shape != (E,) or q_MK.stride(1) != 1:
        raise ValueError("fp8_block_mm needs offsets [E] and a's codes with unit column stride")
    if 1 not in q_EKN.stride()[1:]:
        raise ValueError(f"fp8_block_mm: b needs a unit K or N stride, got {q_EKN.stride()}")


@torch.library.custom_op("moe::fp8_block_mm", mutates_args=())
def block_mm(
    q_MK: torch.Tensor,
    s_MB: torch.Tensor,
    q_EKN: torch.Tensor,
    s_EKN: torch.Tensor,
    offsets_E: torch.Tensor,
    out_dtype: torch.dtype,
    q2_MK: torch.Tensor | None = None,
    s2_MB: torch.Tensor | None = None,
    q2_EKN: torch.Tensor | None = None,
    s2_EKN: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[rows of e] = dequantized a[rows of e] @ dequantized b[e] (see the module docstring), in
    out_dtype (float32 accumulation); tail rows zero. Codes e4m3 (or their uint8 view). With
    the second operands (shapes and strides as the first's): + a2 @ b2 in the same float32 sum,
    one launch (the SwiGLU MLP's input gradient dh @ w1^T + dg @ w3^T)."""
    check(q_MK, s_MB, q_EKN, s_EKN, offsets_E)
    one, two = (q_MK, s_MB, q_EKN, s_EKN), (q2_MK, s2_MB, q2_EKN, s2_EKN)
    pair = any(t is not None for t in two)
    if pair:
        if any(t is None or t.shape != u.shape or t.stride() != u.stride()
               for t, u in zip(two, one)):  # fmt: skip
            raise ValueError("fp8_block_mm: the second operands need the first's shapes, strides")
        check(*two, offsets_E)
    else:
        two = one  # (not read)
    (M, K), (E, _, N) = q_MK.shape, q_EKN.shape
    out = torch.empty((M, N), dtype=out_dtype, device=q_MK.device)
    if M == 0:
        return out
    b = q_EKN.view(torch.float8_e4m3fn)

    def grid(meta):
        return (max_row_tiles(M, E, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _block_mm_kernel[grid](
        q_MK.view(torch.float8_e4m3fn), s_MB, b, s_EKN, out, offsets_E.to(torch.int32),
        M, N, K, E, m_bucket(M),
        q_MK.stride(0), *s_MB.stride(), *b.stride(), *s_EKN.stride(),
        two[0].view(torch.float8_e4m3fn), two[1], two[2].view(torch.float8_e4m3fn), two[3],
        E_POW2=e_pow2(E), TWO=pair, DECODE=interpreting(),
        RNE_BF16=interpreting() and out_dtype == torch.bfloat16,
    )  # fmt: skip
    return out


@block_mm.register_fake
def _(q_MK, s_MB, q_EKN, s_EKN, offsets_E, out_dtype, q2_MK=None, s2_MB=None, q2_EKN=None,
      s2_EKN=None):  # fmt: skip
    return q_MK.new_empty(q_MK.shape[0], q_EKN.shape[2], dtype=out_dtype)
