"""The FP8 dispatch payload written in ONE Triton launch (issue 61): each row's 1 x block amax,
scale (fp32, power of two, or its UE8M0 byte), cap and e4m3 codes, stored straight into the
packed uint8 row buffer the exchange sends (moe/fp8/payload.py's layout), where the eager chain
quantizes, then concatenates the codes and the scales into the buffer (a second pass over the
codes). Any width, any scale block up to MAX_BLOCK elements (a partial last block). The same
bytes as payload.pack_rows(*payload.quantize_payload(x)) (the jit helpers are
moe/fp8/triton_quant.py's; tests/test_fp8_rows.py runs it in Triton's interpreter).
"""

import torch
import triton
import triton.language as tl

from moe.fp8.triton_quant import _cap, _e4m3_code, _nan_max, _scale

BLOCKS_PER_PROGRAM = 4
MAX_BLOCK = 1024  # widest scale block in registers (wider: the eager chain)


@triton.jit
def _payload_kernel(x_ptr, p_ptr, M, D, nb, eb, stride_x, P, floor,
                    POW2: tl.constexpr, UE8M0: tl.constexpr, BLOCK_M: tl.constexpr,
                    BP: tl.constexpr):  # fmt: skip
    """Programs over the M * nb (row, block) pairs, BLOCK_M at a time; eb elements a block."""
    pairs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ok = pairs < M * nb
    r = (pairs // nb).to(tl.int64)
    j = pairs % nb
    cols = j[:, None] * eb + tl.arange(0, BP)[None, :]
    ok = pair_ok[:, None] & (tl.arange(0, BP)[None, :] < eb) & (cols < D)
    x = tl.load(x_ptr + r[:, None] * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = _scale(tl.reduce(tl.abs(x), 1, _nan_max), floor, POW2)
    c = _cap(scale)[:, None]
    v = x / scale[:, None]
    v = tl.where(v > c, c, tl.where(v < -c, -c, v))
    code = _e4m3_code(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    tl.store(p_ptr + r[:, None] * P + cols, code, mask=ok)
    if UE8M0:  # a power of two's biased exponent (255: Inf / NaN)
        byte = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        byte = byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        tl.store(p_ptr + r * P + D + j, byte, mask=pair_ok)
    else:  # float32 scales at byte D + 4 j of the row, little-endian (as .view(torch.uint8))
        bits = scale.to(tl.int32, bitcast=True)
        for k in tl.static_range(4):
            byte = ((bits >> (8 * k)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            tl.store(p_ptr + r * P + D + 4 * j + k, byte, mask=pair_ok)


def fits(x: torch.Tensor, block: int) -> bool:
    """The one-launch payload applies: 2-D rows with unit column stride, a scale block of at
    most MAX_BLOCK elements."""
    return (
        x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1 and min(block, x.shape[1]) <= MAX_BLOCK
    )


def payload_triton(x_ND: torch.Tensor, block: int, scale_format: str, floor: float):
    """pack_rows(*quantize_payload(x, block, scale_format, floor), scale_format) in one launch
    (where `fits`)."""
    N, D = x_ND.shape
    eb = min(block, D)
    nb = -(-D // eb)
    P = D + (nb if scale_format == "ue8m0" else 4 * nb)
    out = torch.empty((N, P), dtype=torch.uint8, device=x_ND.device)
    if N:  # (the buffer's bytes passed as e4m3: the codes they mostly are)
        _payload_kernel[(triton.cdiv(N * nb, BLOCKS_PER_PROGRAM),)](
            x_ND, out.view(torch.float8_e4m3fn), N, D, nb, eb, x_ND.stride(0), P, float(floor),
            POW2=scale_format != "fp32", UE8M0=scale_format == "ue8m0",
            BLOCK_M=BLOCKS_PER_PROGRAM, BP=triton.next_power_of_2(eb),
        )  # fmt: skip
    return out
