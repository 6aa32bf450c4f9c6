"""FP8 dispatch payload: token rows as e4m3 bytes plus 1 x block scales, packed into ONE uint8
row buffer that any row exchange moves as it is (moe.comm's AllToAllSplits.run sends rows of any
dtype: flat or hierarchical, the split sizes count rows), and unpacked on arrival (views of the
buffer, no copy, where the scales are aligned). On CUDA `encode_rows` writes the buffer in one
launch (moe/fp8/triton_payload.py).

Row layout of the packed buffer [R, D + S]: D bytes of e4m3 (element order), then the row's
nb = ceil(D / block) scales: 4 * nb bytes of float32 ("fp32", "pow2") or nb bytes of UE8M0
exponents ("ue8m0"). At D = 7168, block 128: 7168 + 224 = 7392 bytes instead of 14336 in bf16.

The exchanges that send it are the generic wire's (moe/dispatch/wire.py) with the FP8 row
format (moe/fp8/wire.py).
"""

import torch
from torch import Tensor

from moe.fp8.quant import (
    AMAX_FLOOR,
    E4M3,
    dequantize_blocks,
    quantize_blocks,
    scales_to_ue8m0,
    ue8m0_to_scales,
)
from moe.kernels.triton_kernel import triton_installed


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


def encode_rows(
    x_RD: Tensor, block: int = 128, scale_format: str = "fp32", floor: float = AMAX_FLOOR
) -> Tensor:
    """x's rows as the packed payload: pack_rows(*quantize_payload(x, ...)), on CUDA in one
    launch (moe/fp8/triton_payload.py, where it fits: the same bytes)."""
    if x_RD.is_cuda and triton_installed():
        from moe.fp8.triton_payload import fits, payload_triton

        if fits(x_RD, block):
            return payload_triton(x_RD.detach(), block, scale_format, floor)
    q_RD, s_RB = quantize_payload(x_RD, block, scale_format, floor)
    return pack_rows(q_RD, s_RB, scale_format)


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
    """Inverse of pack_rows: (uint8 e4m3 bytes [R, D], float32 scales [R, nb]), views of the
    buffer where its float32 scales are 4-byte aligned (D % 4 == 0), else the scales copied."""
    q_RD, s_RS = packed_RP[:, :D], packed_RP[:, D:]
    if scale_format == "ue8m0":
        return q_RD, ue8m0_to_scales(s_RS)
    aligned = s_RS.numel() and s_RS.stride(0) % 4 == 0 and s_RS.storage_offset() % 4 == 0
    return q_RD, (s_RS if aligned else _dense(s_RS)).view(torch.float32)  # a view: no copy
