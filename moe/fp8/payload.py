"""FP8 dispatch payload: token rows as e4m3 bytes plus 1 x block scales, packed into ONE uint8
row buffer that any row exchange moves as it is (moe.comm's AllToAllPlan.run sends rows of any
dtype: flat or hierarchical, the split sizes count rows), and unpacked on arrival.

Row layout of the packed buffer [R, D + S]: D bytes of e4m3 (element order), then the row's
nb = ceil(D / block) scales: 4 * nb bytes of float32 ("fp32", "pow2") or nb bytes of UE8M0
exponents ("ue8m0"). At D = 7168, block 128: 7168 + 224 = 7392 bytes instead of 14336 in bf16.

`fp8_dispatch` / `fp8_combine` are the exchanges of the layer's two directions as autograd
functions (straight-through through the quantizer): dispatch sends FP8 forward and its gradient
home in the input's dtype (or FP8 when asked); combine sends the expert outputs in their dtype
and, with FP8Config.grad_before_down_fp8, its backward (the activation gradient before the
down-projection) in FP8, as DeepSeek-V3 does.
"""

import torch
from torch import Tensor

from moe.fp8.config import FP8Config
from moe.fp8.quant import (
    AMAX_FLOOR,
    E4M3,
    dequantize_blocks,
    quantize_blocks,
    scales_to_ue8m0,
    ue8m0_to_scales,
)


def scale_bytes(D: int, block: int = 128, scale_format: str = "fp32") -> int:
    """Bytes of one row's scales in the packed buffer."""
    nb = -(-D // block)
    return nb if scale_format == "ue8m0" else 4 * nb


def quantize_payload(
    x_RD: Tensor, block: int = 128, scale_format: str = "fp32", floor: float = AMAX_FLOOR
) -> tuple[Tensor, Tensor]:
    """rows -> (e4m3 viewed as uint8 [R, D], float32 scales [R, ceil(D / block)])."""
    q_RD, scales_RB = quantize_blocks(x_RD, block, scale_format != "fp32", floor)
    return q_RD.view(torch.uint8), scales_RB


def dequantize_payload(
    q_RD: Tensor, scales_RB: Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> Tensor:
    """(uint8 e4m3 bytes, scales) -> rows in dtype."""
    return dequantize_blocks(q_RD.view(E4M3), scales_RB, block, dtype)


def _dense(t: Tensor) -> Tensor:
    """t with row-major strides, so that .view(another dtype) works: .contiguous() leaves an
    empty tensor's strides as they are (a [0, nb] amax can have stride 0 in its last dim)."""
    return t.new_empty(t.shape) if t.numel() == 0 else t.contiguous()


def pack_rows(q_RD: Tensor, scales_RB: Tensor, scale_format: str = "fp32") -> Tensor:
    """One contiguous uint8 [R, D + scale bytes] buffer: the bytes, then the row's scales."""
    if scale_format == "ue8m0":
        s_RS = scales_to_ue8m0(scales_RB)
    else:
        s_RS = _dense(scales_RB.float()).view(torch.uint8)
    return torch.cat([_dense(q_RD).view(torch.uint8), s_RS], dim=1)


def unpack_rows(packed_RP: Tensor, D: int, scale_format: str = "fp32") -> tuple[Tensor, Tensor]:
    """Inverse of pack_rows: (uint8 e4m3 bytes [R, D], float32 scales [R, nb])."""
    q_RD, s_RS = packed_RP[:, :D], packed_RP[:, D:]
    if scale_format == "ue8m0":
        return q_RD, ue8m0_to_scales(s_RS)
    return q_RD, _dense(s_RS).view(torch.float32)


def send_fp8(x_ND: Tensor, plan, block: int, scale_format: str, floor: float) -> Tensor:
    """Quantize, pack, exchange by `plan` (anything with .run(rows)), unpack, dequantize to
    x's dtype. No autograd."""
    D = x_ND.shape[1]
    packed = pack_rows(*quantize_payload(x_ND, block, scale_format, floor), scale_format)
    q_MD, scales_MB = unpack_rows(plan.run(packed), D, scale_format)
    return dequantize_payload(q_MD, scales_MB, block, x_ND.dtype)


class _Exchange(torch.autograd.Function):
    """y = exchange(x) by plan, FP8 on the wire forward and/or backward; the gradient of the
    quantizer is straight-through, the backward goes by plan.reverse()."""

    @staticmethod
    def forward(ctx, x_ND, plan, fwd_fp8, bwd_fp8, block, scale_format, floor):
        ctx.plan, ctx.bwd = plan, (bwd_fp8, block, scale_format, floor)
        if fwd_fp8:
            return send_fp8(x_ND, plan, block, scale_format, floor)
        return plan.run(x_ND.contiguous())

    @staticmethod
    def backward(ctx, grad_MD):
        bwd_fp8, block, scale_format, floor = ctx.bwd
        back = ctx.plan.reverse()
        grad_MD = grad_MD.contiguous()
        if bwd_fp8:
            dx = send_fp8(grad_MD, back, block, scale_format, floor)
        else:
            dx = back.run(grad_MD)
        return dx, None, None, None, None, None, None


def fp8_dispatch(x_ND: Tensor, plan, config: FP8Config | None, grad_fp8: bool = False) -> Tensor:
    """The dispatch exchange: FP8 on the wire when config.dispatch (else x's dtype; config
    None: x's dtype both ways); the gradient goes home in the gradient's dtype, or in FP8
    with grad_fp8."""
    c = config
    if c is None:
        if grad_fp8:
            raise ValueError("fp8_dispatch: grad_fp8=True needs an FP8Config, got None")
        return _Exchange.apply(x_ND, plan, False, False, 128, "fp32", AMAX_FLOOR)
    return _Exchange.apply(
        x_ND, plan, c.dispatch, grad_fp8, c.block_size, c.scale_format, c.amax_floor
    )


def fp8_combine(y_ND: Tensor, plan, config: FP8Config | None) -> Tensor:
    """The combine exchange: y's dtype forward; its backward (the gradient before the experts'
    down-projection) in FP8 when config.grad_before_down_fp8 (config None: y's dtype)."""
    c = config
    if c is None:
        return _Exchange.apply(y_ND, plan, False, False, 128, "fp32", AMAX_FLOOR)
    return _Exchange.apply(
        y_ND, plan, False, c.grad_before_down_fp8, c.block_size, c.scale_format, c.amax_floor
    )
