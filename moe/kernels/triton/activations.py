"""Activation epilogues of the grouped GEMMs, forward and backward, on fp32 tiles.

Codes match `ACT_CODES`; the math matches moe/kernels/activations.py ("gelu" is the exact erf
form, "swiglu" is silu(h) * g with h = x @ w1 and g = x @ w3).
"""

import triton
import triton.language as tl

from moe.kernels.triton import lang as tlx

ACT_CODES = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3, "swiglu": 4}

# Constants are tl.constexpr and always sit right of a tensor: constexpr * tensor would wrap the
# tensor in a constexpr under the interpreter.

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_PI = tl.constexpr(0.7978845608028654)
_GELU_C = tl.constexpr(0.044715)


@triton.jit
def _tanh(x):
    # tl has no portable tanh across triton 3.6..3.9; 2*sigmoid(2x) - 1 is exact in fp32 range.
    return 2.0 * tlx.sigmoid(2.0 * x) - 1.0


@triton.jit
def act_fwd(h, g, ACT: tl.constexpr):
    """act(h); for swiglu silu(h) * g."""
    if ACT == 0:
        y = 0.5 * h * (1.0 + tl.erf(h * _SQRT1_2))
    elif ACT == 1:
        y = 0.5 * h * (1.0 + _tanh((h + h * h * h * _GELU_C) * _SQRT_2_PI))
    elif ACT == 2:
        y = tl.where(h > 0, h, 0.0)
    elif ACT == 3:
        y = h * tlx.sigmoid(h)
    else:
        y = h * tlx.sigmoid(h) * g
    return y


@triton.jit
def act_bwd(dy, h, g, ACT: tl.constexpr):
    """(dh, dg) from dy = dL/d act; dg is only meaningful for swiglu."""
    dg = dy
    if ACT == 0:
        cdf = 0.5 * (1.0 + tl.erf(h * _SQRT1_2))
        pdf = tl.exp(-0.5 * h * h) * _INV_SQRT_2PI
        dh = dy * (cdf + h * pdf)
    elif ACT == 1:
        t = _tanh((h + h * h * h * _GELU_C) * _SQRT_2_PI)
        du = (1.0 + h * h * (3.0 * _GELU_C)) * _SQRT_2_PI
        dh = dy * (0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * du)
    elif ACT == 2:
        dh = tl.where(h > 0, dy, 0.0)
    elif ACT == 3:
        s = tlx.sigmoid(h)
        dh = dy * s * (1.0 + h * (1.0 - s))
    else:
        s = tlx.sigmoid(h)
        dh = dy * g * s * (1.0 + h * (1.0 - s))
        dg = dy * h * s
    return dh, dg


@triton.jit
def _act_rows_kernel(
    pre_ptr, scale_ptr, out_ptr, live_ptr, M, F, stride_pm,
    ACT: tl.constexpr, GATED: tl.constexpr, ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    ok = (rows < M)[:, None] & (cols < F)[None, :]
    live_ok = ok & (rows < tl.load(live_ptr).to(tl.int64))[:, None]  # tail rows: act(0) * 0
    ptrs = pre_ptr + rows[:, None] * stride_pm + cols[None, :]
    h = tl.load(ptrs, mask=live_ok, other=0.0).to(tl.float32)
    g = h
    if GATED:
        g = tl.load(ptrs + F, mask=live_ok, other=0.0).to(tl.float32)
    y = act_fwd(h, g, ACT)
    if ROW_SCALE:
        y = y * tl.load(scale_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    y = tl.where(live_ok, y, 0.0)
    tl.store(out_ptr + rows[:, None] * F + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def act_code(activation: str) -> int:
    """The kernels' code of `activation`; ValueError naming the supported ones."""
    if activation not in ACT_CODES:
        raise ValueError(
            f"activation={activation!r} is not supported; choose one of {tuple(ACT_CODES)}"
        )
    return ACT_CODES[activation]


def pre_width(F: int, activation: str) -> int:
    """Columns of the saved pre-activation: [h | g] (2F) for gated activations, else h (F)."""
    from moe.kernels.activations import GATED

    return 2 * F if activation in GATED else F


def act_rows(pre_MP, F: int, activation: str, row_scale_M, offsets_L):
    """a_MF = act(pre) (silu(h) * g for swiglu, pre = [h | g]), times row_scale_M[m] if given:
    the activation recomputed from the saved pre-activation in one pass (read pre, write a).
    Rows at or past offsets_L[-1] (dropped pairs; unwritten by torch._grouped_mm) are not
    read and come out zero."""
    import torch

    from moe.kernels.activations import GATED
    from moe.kernels.triton.common import interpreting

    M = pre_MP.shape[0]
    out = pre_MP.new_empty(M, F)
    if M == 0 or F == 0:
        return out
    bm, bf = (16, 16) if interpreting() else (32, 128)
    grid = (triton.cdiv(M, bm), triton.cdiv(F, bf))
    scale = row_scale_M if row_scale_M is not None else torch.empty(0, device=pre_MP.device)
    _act_rows_kernel[grid](
        pre_MP, scale, out, offsets_L[-1:], M, F, pre_MP.stride(0), ACT=ACT_CODES[activation],
        GATED=activation in GATED, ROW_SCALE=row_scale_M is not None, BLOCK_M=bm, BLOCK_F=bf,
    )  # fmt: skip
    return out
