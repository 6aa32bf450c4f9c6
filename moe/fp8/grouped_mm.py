"""FP8 ragged grouped GEMM, rowwise recipe (torchao's), as torch.library custom ops with fake
and autograd registrations: `moe::fp8_grouped_mm` (forward), `moe::fp8_grouped_mm_dgrad` and
`moe::fp8_grouped_mm_wgrad` (its backward GEMMs), and `moe::fp8_grouped_mm_quantized` (the
forward from x's already-quantized form, for the expert MLP's gate GEMM: x quantized once).

y[rows of e] = x[rows of e] @ w[e], with every GEMM's operands e4m3 and scaled along the
contraction (scales: float32, power-of-two when pow2):
- forward  y = x @ w:      x one scale per row, w one scale per output column (per e, n);
- dgrad   dx = dy @ w^T:   dy one scale per row, w one scale per (e, k) row;
- wgrad   dw = x^T @ dy:   x and dy one scale per column within each expert's rows (the amax
  runs along that expert's tokens).
recipe "blockwise" (DeepSeek-V3's 1 x 128 / 128 x 128 blocks, moe/fp8/blockwise.py) is the
other scaling, emulated on every device. Rows past offsets[-1] (dropped pairs) come out zero and get zero gradients; experts without
rows get zero weight gradients. Outputs are in the input's dtype (x for y and dx, w for dw).

Compute: the emulation (any device) dequantizes the e4m3 operands to float32 and runs the
float32 grouped GEMM (moe.kernels.torch_grouped_mm), i.e. it computes exactly the products of
the quantized operands, accumulated in float32. On CUDA sm_90+ with torch._scaled_grouped_mm
and 16-byte aligned widths the forward and dgrad GEMMs run on it (e4m3 tensor cores; its
output is bf16, then cast to x's dtype). The wgrad on CUDA with pow2 scales (both recipes)
is the Triton FP8 weight-gradient GEMM (moe/fp8/triton_wgrad_gemm.py: e4m3 codes and per-group
column scales, each operand written by one quantization launch, float32 accumulation, output in
w's dtype), on any other device or scaling the float32 emulation. On CUDA that emulation is
per-expert float32 matmuls that read the offsets on the host: the first GPU run
(bench/results/2026-11-28-h200-gpu-check.md) measured it as most of an FP8 step.

save_fp8: the backward keeps x as e4m3 plus its row scales (M*K + 4*M bytes) instead of x
itself (2 or 4 bytes per element); the wgrad then re-quantizes the dequantized x per expert
column (a second rounding the float64 reference reproduces). w is a parameter: kept as is.
"""

import torch
from torch import Tensor

from moe.fp8 import blockwise
from moe.fp8.config import AMAX_FLOOR_RANGE, RECIPES
from moe.fp8.exact_mm import mm_exact
from moe.fp8.quant import (
    AMAX_FLOOR,
    E4M3,
    dequantize,
    dequantize_groups,
    quantize_along,
    quantize_blocks,
    quantize_groups,
)
from moe.fp8.weight_cache import cached_form
from moe.kernels.torch_grouped_mm import mm_groups, wgrad_groups, zero_tail_rows
from moe.kernels.triton_kernel import triton_installed


def _scaled_gemm_ok(a: Tensor, w: Tensor) -> bool:
    """torch._scaled_grouped_mm can take a [M, K] e4m3 x [E, K, N] e4m3 product here."""
    if a.device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(a.device) < (9, 0):
        return False
    return a.shape[1] % 16 == 0 and w.shape[2] % 16 == 0


def column_major(q_EKN: Tensor) -> Tensor:
    """q laid out as torch._scaled_grouped_mm takes its weight: [E, K, N] with K contiguous."""
    return q_EKN if q_EKN.stride(1) == 1 else q_EKN.transpose(1, 2).contiguous().transpose(1, 2)


def weight_forms(w_EKN: Tensor, pow2: bool, floor: float) -> tuple[tuple, tuple]:
    """w's two rowwise operands, made once per optimizer step (moe/fp8/weight_cache.py):
    fprop (e4m3 [E, K, N] column-major, K contiguous: the layout torch._scaled_grouped_mm
    takes; one scale per output column [E, 1, N]) and dgrad (e4m3 [E, K, N] row-major, one
    scale per (e, k) row [E, K, 1]; its transpose [E, N, K] is column-major). On CUDA both in
    ONE Triton launch reading w once: w as [E K, N] rows (dgrad) and as columns within groups
    of K rows written into the transposed copy (fprop), no bf16 transposed copy of w."""

    def make(w):
        E, K, N = w.shape
        if w.is_cuda and triton_installed():
            from moe.fp8.triton_quant import quantize

            ends = torch.arange(1, E + 1, device=w.device, dtype=torch.int32) * K
            q, s, qc, sc = quantize(w.contiguous(), pow2, floor, groups=ends,
                                    transposed=(K, K * (N - 1), (E, N, K)))  # fmt: skip
            fprop = (qc.transpose(1, 2), sc.view(E, 1, N))
            return fprop, (q, s.view(E, K, 1))
        # each column of w is a row of its transpose: one row quantization
        q_ENK, s_EN1 = quantize_along(w.transpose(1, 2).contiguous(), -1, pow2, floor)
        fprop = (q_ENK.transpose(1, 2), s_EN1.transpose(1, 2))
        return fprop, quantize_along(w, 2, pow2, floor)

    return cached_form(("rowwise", pow2, floor), w_EKN, make)


def fprop_weight(w_EKN: Tensor, pow2: bool, floor: float) -> tuple[Tensor, Tensor]:
    """w's forward operand (weight_forms)."""
    return weight_forms(w_EKN, pow2, floor)[0]


def dgrad_weight(w_EKN: Tensor, pow2: bool, floor: float) -> tuple[Tensor, Tensor]:
    """w's input-gradient operand (weight_forms)."""
    return weight_forms(w_EKN, pow2, floor)[1]


def scaled_mm_groups(q_MK, s_M1, q_EKN, s_E1N, offsets_E, out_dtype) -> Tensor:
    """sum_k q[m, k] s[m] * q[e, k, n] s[e, n] per group; tail rows zero; in out_dtype."""
    if _scaled_gemm_ok(q_MK, q_EKN):
        b_EKN = column_major(q_EKN)  # a copy only for a weight not made by fprop_weight
        y = torch._scaled_grouped_mm(
            q_MK.contiguous(), b_EKN, s_M1.reshape(-1), s_E1N.reshape(q_EKN.shape[0], -1),
            offs=offsets_E, out_dtype=torch.bfloat16,
        )  # fmt: skip
        return zero_tail_rows(y, offsets_E).to(out_dtype)  # on CUDA: a pass over the tail only
    w_EKN = dequantize(q_EKN, s_E1N).contiguous()  # dgrad passes a transposed view
    y = mm_groups(dequantize(q_MK, s_M1), w_EKN, offsets_E)
    return y.to(out_dtype)


@torch.library.custom_op("moe::fp8_grouped_mm", mutates_args=())
def _fwd_op(
    x_MK: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    pow2: bool,
    floor: float,
    save_fp8: bool,
    recipe: str = "rowwise",
    wgrad_bf16: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(y_MN, q_MK, s_MB): y = FP8 x @ FP8 w per group in the recipe's scaling; x's quantized
    form (e4m3 bytes as uint8, and its row or 1 x 128 block scales) comes back for the
    backward to keep. wgrad_bf16: the backward's dw from unquantized operands (x as kept)."""
    if recipe == "blockwise":
        y, q_MK, s_MB = blockwise.forward(x_MK, w_EKN, offsets_E, pow2, floor)
        return y.to(x_MK.dtype), q_MK, s_MB
    q_MK, s_M1 = quantize_along(x_MK, -1, pow2, floor)
    q_EKN, s_E1N = fprop_weight(w_EKN, pow2, floor)
    y = scaled_mm_groups(q_MK, s_M1, q_EKN, s_E1N, offsets_E, x_MK.dtype)
    return y, q_MK.view(torch.uint8), s_M1


@_fwd_op.register_fake
def _(x_MK, w_EKN, offsets_E, pow2, floor, save_fp8, recipe="rowwise", wgrad_bf16=False):
    (M, K), N = x_MK.shape, w_EKN.shape[2]
    nb = -(-K // blockwise.BLOCK) if recipe == "blockwise" else 1
    return (
        x_MK.new_empty(M, N),
        x_MK.new_empty(x_MK.shape, dtype=torch.uint8),
        x_MK.new_empty(M, nb, dtype=torch.float32),
    )


@torch.library.custom_op("moe::fp8_grouped_mm_quantized", mutates_args=())
def _fwd_quantized_op(
    q_MK: Tensor,
    s_MB: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    pow2: bool,
    floor: float,
    recipe: str,
    out_dtype: torch.dtype,
) -> Tensor:
    """y = x @ FP8 w per group from x's quantized form (q_MK, s_MB as moe::fp8_grouped_mm
    returns them): the same values as that op on x, without quantizing x again (the expert
    MLP's gate GEMM shares the up GEMM's e4m3 x)."""
    if recipe == "blockwise":
        if blockwise.fused(q_MK, w_EKN, pow2):
            return blockwise.from_codes(q_MK, s_MB, (w_EKN,), offsets_E, pow2, floor, out_dtype)[0]
        x_q = blockwise.saved_x(q_MK, s_MB)
        y = mm_exact(x_q, blockwise.weight(w_EKN, pow2, floor), offsets_E, pow2)
        return y.to(out_dtype)
    q_EKN, s_E1N = fprop_weight(w_EKN, pow2, floor)
    return scaled_mm_groups(q_MK.view(E4M3), s_MB, q_EKN, s_E1N, offsets_E, out_dtype)


@_fwd_quantized_op.register_fake
def _(q_MK, s_MB, w_EKN, offsets_E, pow2, floor, recipe, out_dtype):
    return q_MK.new_empty(q_MK.shape[0], w_EKN.shape[2], dtype=out_dtype)


def quantize_input(x_MK: Tensor, pow2: bool, floor: float, recipe: str) -> tuple[Tensor, Tensor]:
    """x's (e4m3 bytes as uint8, scales) exactly as moe::fp8_grouped_mm's forward makes them."""
    if recipe == "blockwise":
        q, s = quantize_blocks(x_MK, blockwise.BLOCK, pow2, floor)
    else:
        q, s = quantize_along(x_MK, -1, pow2, floor)
    return q.view(torch.uint8), s


def kept_input(saved: tuple, recipe: str) -> Tensor:
    """The wgrad's x from what a forward kept: (x,) itself or its (e4m3 bytes, scales)."""
    if len(saved) == 1:
        return saved[0]
    if recipe == "blockwise":
        return blockwise.saved_x(*saved)
    return dequantize(saved[0].view(E4M3), saved[1])


@torch.library.custom_op("moe::fp8_grouped_mm_dgrad", mutates_args=())
def _dgrad_op(
    dy_MN: Tensor, w_EKN: Tensor, offsets_E: Tensor, pow2: bool, floor: float, recipe: str
) -> Tensor:
    """dx = FP8 dy @ FP8 w^T per group (rowwise: dy per row, w per (e, k)); tail rows zero."""
    if recipe == "blockwise":
        return blockwise.dgrad(dy_MN, w_EKN, offsets_E, pow2, floor).to(dy_MN.dtype)
    q_MN, s_M1 = quantize_along(dy_MN, -1, pow2, floor)
    return _dgrad_rows(q_MN, s_M1, w_EKN, offsets_E, pow2, floor, dy_MN.dtype)


@_dgrad_op.register_fake
def _(dy_MN, w_EKN, offsets_E, pow2, floor, recipe):
    return dy_MN.new_empty(dy_MN.shape[0], w_EKN.shape[1])


def _dgrad_rows(q_MN, s_M1, w_EKN, offsets_E, pow2, floor, out_dtype) -> Tensor:
    q_EKN, s_EK1 = dgrad_weight(w_EKN, pow2, floor)
    w_t = (q_EKN.transpose(1, 2), s_EK1.transpose(1, 2))  # [E, N, K] and [E, 1, K]
    return scaled_mm_groups(q_MN, s_M1, *w_t, offsets_E, out_dtype)


@torch.library.custom_op("moe::fp8_grouped_mm_dgrad_quantized", mutates_args=())
def _dgrad_quantized_op(
    q_MN: Tensor,
    s_M1: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    pow2: bool,
    floor: float,
    out_dtype: torch.dtype,
) -> Tensor:
    """moe::fp8_grouped_mm_dgrad (rowwise) from dy's row-wise form (e4m3 bytes as uint8, row
    scales), made by the launch that also wrote dy's weight-gradient operand."""
    return _dgrad_rows(q_MN.view(E4M3), s_M1, w_EKN, offsets_E, pow2, floor, out_dtype)


@_dgrad_quantized_op.register_fake
def _(q_MN, s_M1, w_EKN, offsets_E, pow2, floor, out_dtype):
    return q_MN.new_empty(q_MN.shape[0], w_EKN.shape[1], dtype=out_dtype)


@torch.library.custom_op("moe::fp8_grouped_mm_wgrad", mutates_args=())
def _wgrad_op(
    x_MK: Tensor,
    dy_MN: Tensor,
    offsets_E: Tensor,
    pow2: bool,
    floor: float,
    recipe: str,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """dw[e] = x^T dy over e's rows, both scaled per column within e's rows (blockwise: within
    each 128-row tile of them); in out_dtype (the weight's: on CUDA the FP8 GEMM writes it)."""
    if pow2 and x_MK.is_cuda and triton_installed():  # one launch per operand, the FP8 GEMM
        from moe.fp8.triton_wgrad_gemm import column_codes, fp8_wgrad_gemm, scaling_groups

        M = x_MK.shape[0]
        groups = scaling_groups(offsets_E, M, recipe)
        a, d = (column_codes(t.contiguous(), groups, offsets_E, pow2, floor) for t in (x_MK, dy_MN))
        return fp8_wgrad_gemm(a, d, offsets_E, M, recipe, out_dtype)
    if recipe == "blockwise":
        return blockwise.wgrad(x_MK, dy_MN, offsets_E, pow2, floor).to(out_dtype)
    x_q = dequantize_groups(*quantize_groups(x_MK, offsets_E, pow2, floor), offsets_E)
    dy_q = dequantize_groups(*quantize_groups(dy_MN, offsets_E, pow2, floor), offsets_E)
    return wgrad_groups(x_q, dy_q, offsets_E).to(out_dtype)


@_wgrad_op.register_fake
def _(x_MK, dy_MN, offsets_E, pow2, floor, recipe, out_dtype=torch.float32):
    return x_MK.new_empty(offsets_E.shape[0], x_MK.shape[1], dy_MN.shape[1], dtype=out_dtype)


def _setup_context(ctx, inputs, output):
    x_MK, w_EKN, offsets_E, pow2, floor, save_fp8, recipe, *wgrad_bf16 = inputs
    ctx.gemm, ctx.x_dtype = (pow2, floor, recipe), x_MK.dtype
    ctx.wgrad_bf16 = bool(wgrad_bf16 and wgrad_bf16[0])
    saved_x = (output[1], output[2]) if save_fp8 else (x_MK,)
    ctx.save_for_backward(w_EKN, offsets_E, *saved_x)


def _backward(ctx, dy_MN, _dq, _ds):
    if torch.is_grad_enabled():
        raise NotImplementedError("moe::fp8_grouped_mm has no double backward")
    w_EKN, offsets_E, *saved_x = ctx.saved_tensors
    dx = dw = None
    if dy_MN is None:
        return None, None, None, None, None, None, None, None
    dy_MN = dy_MN.contiguous()
    if ctx.needs_input_grad[0]:
        dx = _dgrad_op(dy_MN, w_EKN, offsets_E, *ctx.gemm).to(ctx.x_dtype)
    if ctx.needs_input_grad[1]:
        x_MK = kept_input(tuple(saved_x), ctx.gemm[2])
        if ctx.wgrad_bf16:  # FP8Config.wgrad_bf16: x as kept, dy, in dy's dtype
            dw = wgrad_groups(x_MK.to(dy_MN.dtype).contiguous(), dy_MN, offsets_E)
            dw = dw.to(w_EKN.dtype)
        else:
            dw = _wgrad_op(x_MK, dy_MN, offsets_E, *ctx.gemm, w_EKN.dtype)
    return dx, dw, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def check_gemm(x_shape, w_EKN: Tensor, offsets_E: Tensor, recipe: str) -> None:
    """One clear error before any work for operands fp8_grouped_mm cannot take."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8_grouped_mm: recipe must be one of {RECIPES}, got {recipe!r}")
    if len(x_shape) != 2 or w_EKN.dim() != 3 or x_shape[1] != w_EKN.shape[1]:
        raise ValueError(
            f"fp8_grouped_mm needs x_MK [M, K] and w_EKN [E, K, N] with equal K, got "
            f"{tuple(x_shape)} and {tuple(w_EKN.shape)}"
        )
    if offsets_E.shape != (w_EKN.shape[0],):
        raise ValueError(f"offsets_E must be [{w_EKN.shape[0]}], got {tuple(offsets_E.shape)}")


def fp8_grouped_mm(
    x_MK: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    *,
    pow2: bool = True,
    floor: float = AMAX_FLOOR,
    save_fp8: bool = True,
    recipe: str = "rowwise",
    wgrad_bf16: bool = False,
) -> Tensor:
    """Ragged grouped GEMM in FP8 (recipe "rowwise" or "blockwise", see the module docstring);
    differentiable in x and w (with wgrad_bf16, FP8Config's: w's gradient from unquantized
    operands in dy's dtype). offsets_E: int32 cumulative row ends on x's device."""
    check_gemm(x_MK.shape, w_EKN, offsets_E, recipe)
    lo, hi = AMAX_FLOOR_RANGE
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not lo <= floor <= hi:
        raise ValueError(f"fp8_grouped_mm: floor must be in [{lo:.4g}, {hi:g}], got {floor!r}")
    y, _, _ = _fwd_op(
        x_MK.contiguous(), w_EKN.contiguous(), offsets_E.to(torch.int32), pow2, float(floor),
        save_fp8, recipe, wgrad_bf16,
    )  # fmt: skip
    return y
