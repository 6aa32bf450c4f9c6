"""Naive FP8 references for tests/test_fp8_*.py: the same quantization as moe/fp8 written as
loops over rows, blocks and experts (scales in float32 as the format defines them, products
and sums in float64), never for speed."""

import math

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
AMAX_FLOOR = 448 * 2.0**-126  # the library's default: the smallest amax with a normal scale


def ref_scale(amax: float, pow2: bool, floor: float = AMAX_FLOOR) -> torch.Tensor:
    """max(amax, floor) / 448 in float32, rounded up to a power of two if pow2."""
    s = torch.tensor(max(amax, floor), dtype=torch.float32) / 448.0
    if pow2:
        m, e = math.frexp(float(s))
        s = s if m == 0.5 else torch.tensor(2.0**e, dtype=torch.float32)
    return s


def ref_quant(v: torch.Tensor, pow2: bool) -> torch.Tensor:
    """One slice (any shape) with one scale: its dequantized e4m3 values, exact in float64
    (the library's float32 dequantization is this rounded to float32)."""
    v32 = v.detach().float()
    s = ref_scale(float(v32.abs().max()) if v32.numel() else 0.0, pow2)
    q = (v32 / s).clamp(-448, 448).to(E4M3)
    return q.double() * s.double()


def ref_rows(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    """Rowwise (one scale per row of a 2D tensor)."""
    return torch.stack([ref_quant(r, pow2) for r in x]) if len(x) else x.detach().double()


def ref_blocks(x: torch.Tensor, block: int, pow2: bool) -> torch.Tensor:
    """1 x block along the last dim of a 2D tensor."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        for j in range(0, x.shape[1], block):
            out[i, j : j + block] = ref_quant(x[i, j : j + block], pow2)
    return out


def ref_weight_blocks(w_KN: torch.Tensor, block: int, pow2: bool) -> torch.Tensor:
    """block x block scales over a 2D weight."""
    out = torch.empty(w_KN.shape, dtype=torch.float64)
    for i in range(0, w_KN.shape[0], block):
        for j in range(0, w_KN.shape[1], block):
            blk = w_KN[i : i + block, j : j + block]
            out[i : i + block, j : j + block] = ref_quant(blk, pow2)
    return out


def ref_row_tiles(x_nK: torch.Tensor, tile: int, pow2: bool) -> torch.Tensor:
    """One scale per column within each tile of `tile` rows (of one expert's rows)."""
    parts = [ref_rows(x_nK[i : i + tile].t(), pow2).t() for i in range(0, x_nK.shape[0], tile)]
    return torch.cat(parts) if parts else x_nK.detach().double()


class RefFP8Gemm(torch.autograd.Function):
    """One expert's y = x @ w with FP8 operands, float64 products. rowwise: x per row, w per
    column; dx from rowwise dy and w per row; dw from x and dy per column over these rows.
    blockwise: x and dy 1 x 128, w 128 x 128 (both GEMMs), dw from 128-row tiles."""

    @staticmethod
    def forward(ctx, x_nK, w_KN, pow2, save_fp8, recipe="rowwise"):
        if recipe == "blockwise":
            xq, wq = ref_blocks(x_nK, 128, pow2), ref_weight_blocks(w_KN, 128, pow2)
        else:
            xq, wq = ref_rows(x_nK, pow2), ref_rows(w_KN.t(), pow2).t()
        ctx.save_for_backward(xq if save_fp8 else x_nK, w_KN)
        ctx.pow2, ctx.recipe = pow2, recipe
        return xq @ wq

    @staticmethod
    def backward(ctx, dy_nN):
        x_nK, w_KN = ctx.saved_tensors
        p = ctx.pow2
        if ctx.recipe == "blockwise":
            dx = ref_blocks(dy_nN, 128, p) @ ref_weight_blocks(w_KN, 128, p).t()
            dw = ref_row_tiles(x_nK, 128, p).t() @ ref_row_tiles(dy_nN, 128, p)
            return dx, dw, None, None, None
        dx = ref_rows(dy_nN, p) @ ref_rows(w_KN, p).t()
        dw = ref_rows(x_nK.t(), p) @ ref_rows(dy_nN.t(), p).t()
        return dx, dw, None, None, None


def ref_grouped(x_MK, w_EKN, offsets, pow2=True, save_fp8=True, recipe="rowwise"):
    """Grouped FP8 GEMM by a loop over experts; rows past offsets[-1] zero."""
    ends = [int(o) for o in offsets]
    out = [RefFP8Gemm.apply(x_MK[s:t], w_EKN[e], pow2, save_fp8, recipe)
           for e, (s, t) in enumerate(zip([0] + ends[:-1], ends))]  # fmt: skip
    tail = x_MK.new_zeros(x_MK.shape[0] - ends[-1], w_EKN.shape[2], dtype=torch.float64)
    return torch.cat(out + [tail])


def ref_fp8_mlp(
    x_TD, offsets, w1, w2, w3, b1, b2, ids, rw, pow2=True, save_fp8=True, recipe="rowwise"
):
    """SwiGLU expert MLP with every GEMM FP8, rows summed into their tokens (float64)."""
    y = torch.zeros(x_TD.shape[0], w2.shape[2], dtype=torch.float64)
    ends = [int(o) for o in offsets]
    for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
        if t == s:
            continue
        xr = x_TD.double()[ids[s:t]]
        h = RefFP8Gemm.apply(xr, w1[e].double(), pow2, save_fp8, recipe) + b1[e].double()
        g = RefFP8Gemm.apply(xr, w3[e].double(), pow2, save_fp8, recipe)
        a = F.silu(h) * g * rw[s:t].double().unsqueeze(1)
        out = RefFP8Gemm.apply(a, w2[e].double(), pow2, save_fp8, recipe)
        out = out + b2[e].double() * rw[s:t].double().unsqueeze(1)
        y = y.index_add(0, ids[s:t], out)
    return y


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's compute_error)."""
    ref, got = ref.detach().double(), got.detach().double()
    return 20 * math.log10(float(ref.norm() / (ref - got).norm()))
