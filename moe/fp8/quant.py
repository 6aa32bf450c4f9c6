"""e4m3 quantizers (torch.float8_e4m3fn) and their dequantizers, plain torch on any device.

Every scale is max(amax, amax_floor) / 448 (DeepEP's convention; 448 is e4m3's largest finite
value), optionally rounded UP to a power of two (so |x| / scale <= 448 still holds and the scale
is exactly a UE8M0 exponent). q = clamp(x / scale, -448, 448) cast to e4m3 (round to nearest
even), computed in float32; dequantized x = float32(q) * scale. A block of zeros gets the floor's
finite scale and stays zero; the largest finite float32, bf16 or float16 input does not overflow
(float16: the dequantized value saturates at 65504 where a power-of-two scale rounds it up past).

Special values (issue 49):
- the default floor, AMAX_FLOOR = 448 * 2^-126 (~5.3e-36), is the smallest amax whose scale is
  a normal float32 (2^-126, UE8M0 byte 1): a block of any float32 / bf16 magnitude keeps e4m3's
  relative precision (gradients scaled by 1e-30 included); a block below it (zeros) gets scale
  2^-126, under which every normal float32 is still a normal e4m3 code. A larger floor
  (DeepEP's 1e-4) coarsens every block whose amax is below it, gradients included.
- non-finite in, non-finite out: a block holding Inf or NaN gets a non-finite scale in every
  scale format (pow2_ceil keeps Inf / NaN, UE8M0 sends them as byte 255) and comes back NaN.

Scale layouts (scales always float32, broadcastable against q where that is natural):
- along a dim (`quantize_along`): rowwise activations (dim -1: one scale per row), weights per
  output column (w_EKN, dim 1) or per row (dim 2);
- 1 x block along the last dim (`quantize_blocks`): scales [..., ceil(D / block)], the last
  block partial when D % block != 0 (the dispatch format);
- block x block over the last two dims (`quantize_weight_blocks`);
- per column within each expert's rows (`quantize_groups`): the weight-gradient GEMM's
  operands, scaled along the token dimension per expert group.
"""

import torch
from torch import Tensor

from moe.kernels.triton_kernel import triton_installed

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = E4M3_MAX * 2.0**-126  # 7 * 2^-120 ~ 5.27e-36: the scale floor is 2^-126, exactly
UE8M0_NONFINITE = 255  # the E8M0 NaN byte: a block holding Inf or NaN


def pow2_ceil(scale: Tensor) -> Tensor:
    """The smallest power of two >= scale (exact: frexp, no log2 rounding); Inf and NaN stay
    as they are (frexp gives them exponent 0, which would read as 1)."""
    mant, exp = torch.frexp(scale)
    keep = (mant == 0.5) | ~torch.isfinite(mant)
    return torch.where(keep, scale, torch.ldexp(torch.ones_like(scale), exp))


def scale_of(amax: Tensor, pow2: bool = False, floor: float = AMAX_FLOOR) -> Tensor:
    """max(amax, floor) / 448 in float32, rounded up to a power of two if pow2. An amax of Inf
    or NaN (a block holding one) gives an Inf or NaN scale: the block dequantizes to NaN."""
    scale = amax.float().clamp(min=floor) / E4M3_MAX
    return pow2_ceil(scale) if pow2 else scale


def e4m3_cap(scale: Tensor) -> Tensor:
    """The largest e4m3 value c with c * scale finite in float32: 448, or less for scales
    above float32's max / 448 (a power-of-two scale of the largest float32 input: its e4m3
    value would round up to 2^128)."""
    lim = (torch.finfo(torch.float32).max / scale).clamp(max=E4M3_MAX)
    c = lim.to(E4M3)
    step = (c.float() > lim).to(torch.uint8)  # rounded up past the limit: one code down
    return (c.view(torch.uint8) - step).view(E4M3).float()


def to_e4m3(x: Tensor, scale: Tensor, cap: Tensor | None = None) -> Tensor:
    """clamp(x / scale, +-cap) as e4m3 (cap = e4m3_cap(scale), 448 for every scale but the
    largest; given: e4m3_cap of the scale, e.g. of compact block scales before expanding), in
    float32; scale broadcasts against x."""
    cap = e4m3_cap(scale) if cap is None else cap
    return torch.clamp(x.float() / scale, -cap, cap).to(E4M3)


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """float32(q) * scale, cast to dtype (scale broadcasts against q). For a dtype whose range
    ends below float32's top binade (float16) the product saturates at the dtype's largest
    finite value: the quantized input was finite there, and a power-of-two scale can round it
    up past (65504 -> 65536); NaN (a non-finite block) stays NaN."""
    x = q.float() * scale
    if dtype.is_floating_point and torch.finfo(dtype).max < 2.0**127:
        big = torch.finfo(dtype).max
        x = x.clamp(-big, big)
    return x.to(dtype)


def quantize_along(
    x: Tensor, dim: int = -1, pow2: bool = False, floor: float = AMAX_FLOOR
) -> tuple[Tensor, Tensor]:
    """One scale per slice along `dim` (the amax is taken over dim): (q, scale keepdim). Along
    the last dim of a CUDA tensor (rows with unit stride, 2-D or contiguous): one Triton launch
    (moe/fp8/triton_quant.py, the same codes and scales)."""
    rows = x.dim() >= 1 and dim in (-1, x.dim() - 1) and x.stride(-1) == 1
    if x.is_cuda and rows and (x.dim() == 2 or x.is_contiguous()) and triton_installed():
        from moe.fp8.triton_quant import quantize_rows_triton

        return quantize_rows_triton(x, pow2, floor)
    scale = scale_of(x.detach().abs().amax(dim=dim, keepdim=True), pow2, floor)
    return to_e4m3(x.detach(), scale), scale


def _blocks_last(x: Tensor, block: int) -> Tensor:
    """x [..., D] zero-padded to [..., nb, block] (nb = ceil(D / block)); a block wider than
    the row is the row (no padding to the block's width: the same amax)."""
    D = x.shape[-1]
    block = min(block, max(D, 1))
    nb = -(-D // block)
    if nb * block != D:
        x = torch.nn.functional.pad(x, (0, nb * block - D))
    return x.reshape(*x.shape[:-1], nb, block)


def quantize_blocks(
    x: Tensor, block: int = 128, pow2: bool = False, floor: float = AMAX_FLOOR
) -> tuple[Tensor, Tensor]:
    """1 x block scales along the last dim: (q [..., D], scales [..., ceil(D / block)]). On
    CUDA with D a multiple of the block (rows with unit stride, contiguous): the row quantizer
    over the blocks as rows, one Triton launch (the same codes and scales)."""
    D = x.shape[-1]
    if x.is_cuda and 0 < block <= D and D % block == 0 and x.is_contiguous() and triton_installed():
        from moe.fp8.triton_quant import quantize_rows_triton

        q, s = quantize_rows_triton(x.detach().view(-1, block), pow2, floor)
        return q.view(x.shape), s.view(*x.shape[:-1], D // block)
    xb = _blocks_last(x.detach().float(), block)
    scales = scale_of(xb.abs().amax(dim=-1), pow2, floor)
    q = to_e4m3(xb, scales.unsqueeze(-1)).flatten(-2)[..., :D].contiguous()
    return q, scales


def expand_blocks(scales: Tensor, D: int, block: int = 128) -> Tensor:
    """Scales [..., nb] repeated to one per element [..., D]."""
    return scales.repeat_interleave(min(block, max(D, 1)), dim=-1)[..., :D]


def dequantize_blocks(q: Tensor, scales: Tensor, block: int = 128, dtype=torch.float32) -> Tensor:
    """Inverse of quantize_blocks (up to the rounding of e4m3). Full blocks: on CUDA one
    Triton launch (bf16 / float32), else the scales broadcast over each block (no per-element
    copy of them)."""
    D = q.shape[-1]
    one_launch = q.is_cuda and q.dim() == 2 and q.stride(-1) == 1 and triton_installed()
    if (
        one_launch
        and dtype in (torch.bfloat16, torch.float32)
        and 0 < block <= D
        and D % block == 0
    ):
        from moe.fp8.triton_blocks import dequantize_triton  # (no saturation to apply)

        return dequantize_triton(q, scales.contiguous(), dtype)
    if 0 < block <= D and D % block == 0:
        blocks = q.reshape(*q.shape[:-1], D // block, block)
        return dequantize(blocks, scales.unsqueeze(-1), dtype).reshape(q.shape)
    return dequantize(q, expand_blocks(scales, D, block), dtype)


def quantize_weight_blocks(
    w: Tensor, block: int = 128, pow2: bool = False, floor: float = AMAX_FLOOR
) -> tuple[Tensor, Tensor]:
    """block x block scales over the last two dims: (q [..., K, N], scales [..., kb, nb])."""
    K, N = w.shape[-2:]
    wb = _blocks_last(w.detach().float(), block)  # [..., K, nb, block]
    wb = _blocks_last(wb.transpose(-3, -1), block)  # [..., block, nb, kb, block]
    scales = scale_of(wb.abs().amax(dim=(-4, -1)), pow2, floor).transpose(-2, -1)  # [.., kb, nb]
    cap = expand_weight_blocks(e4m3_cap(scales), K, N, block)  # per block, then expanded
    return to_e4m3(w.detach(), expand_weight_blocks(scales, K, N, block), cap), scales


def expand_weight_blocks(scales: Tensor, K: int, N: int, block: int = 128) -> Tensor:
    """Scales [..., kb, nb] repeated to one per element [..., K, N]."""
    s = scales.repeat_interleave(min(block, max(K, 1)), dim=-2)[..., :K, :]
    return s.repeat_interleave(min(block, max(N, 1)), dim=-1)[..., :N]


def group_of_rows(offsets_E: Tensor, M: int) -> Tensor:
    """Group id of each of M rows (offsets_E: int32 cumulative row ends); tail rows get E."""
    rows = torch.arange(M, device=offsets_E.device, dtype=offsets_E.dtype)
    return torch.searchsorted(offsets_E, rows, right=True)


def quantize_groups(
    x_MK: Tensor, offsets_E: Tensor, pow2: bool = False, floor: float = AMAX_FLOOR
) -> tuple[Tensor, Tensor]:
    """One scale per column within each group's rows (the amax runs along the tokens of one
    expert): (q [M, K], scales [E, K]). Tail rows past offsets_E[-1] quantize to zero; an empty
    group's scales are the floor's."""
    E, M = offsets_E.shape[0], x_MK.shape[0]
    group_M = group_of_rows(offsets_E, M)
    ends = torch.cat([offsets_E.long(), offsets_E.new_full((1,), M, dtype=torch.long)])
    lengths = torch.diff(ends, prepend=ends.new_zeros(1))  # E groups, then the tail
    amax = torch.segment_reduce(
        x_MK.detach().abs().float(), "max", lengths=lengths, axis=0, unsafe=True, initial=0.0
    )  # rows are sorted by group: a segment max, no scatter
    scales = scale_of(amax, pow2, floor)
    scales[E] = 1.0  # the tail rows' scale: the rows are zeroed below
    x_kept = x_MK.detach().float().masked_fill((group_M == E).unsqueeze(1), 0)
    return to_e4m3(x_kept, scales.index_select(0, group_M.long())), scales[:E]


def dequantize_groups(q_MK: Tensor, scales_EK: Tensor, offsets_E: Tensor) -> Tensor:
    """Inverse of quantize_groups in float32 (tail rows zero)."""
    s = torch.cat([scales_EK, scales_EK.new_zeros(1, scales_EK.shape[1])])
    return q_MK.float() * s.index_select(0, group_of_rows(offsets_E, q_MK.shape[0]).long())


def row_tiles(offsets_E: Tensor, M: int, tile: int) -> tuple[Tensor, int]:
    """(segment of each row, S): rows cut into tiles of `tile` rows within each group (the
    last tile of a group partial); tail rows past offsets_E[-1] form segment S - 1. Segments
    follow the row order; S is a bound known without reading the offsets."""
    E = offsets_E.shape[0]
    group_M = group_of_rows(offsets_E, M).long()
    ends = offsets_E.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + tile - 1) // tile
    S = M // tile + E + 2
    first = torch.cat([torch.cumsum(tiles, 0) - tiles, ends.new_zeros(1)])
    local = (
        torch.arange(M, device=offsets_E.device) - torch.cat([starts, ends.new_zeros(1)])[group_M]
    )
    seg_M = torch.where(group_M == E, S - 1, first[group_M] + local // tile)
    return seg_M, S


def quantize_row_tiles(
    x_MK: Tensor, offsets_E: Tensor, tile: int = 128, pow2: bool = False, floor: float = AMAX_FLOOR
) -> tuple[Tensor, Tensor, Tensor]:
    """One scale per column within each tile of `tile` rows of one group (the amax runs
    along up to `tile` tokens of one expert): (q [M, K], scales [S, K], segment of each row).
    Tail rows quantize to zero."""
    M = x_MK.shape[0]
    seg_M, S = row_tiles(offsets_E, M, tile)
    lengths = torch.zeros(S, dtype=torch.long, device=x_MK.device)
    lengths.scatter_add_(0, seg_M, torch.ones_like(seg_M))
    amax = torch.segment_reduce(
        x_MK.detach().abs().float(), "max", lengths=lengths, axis=0, unsafe=True, initial=0.0
    )
    scales = scale_of(amax, pow2, floor)
    scales[S - 1] = 1.0  # the tail rows' scale: the rows are zeroed below
    x_kept = x_MK.detach().float().masked_fill((seg_M == S - 1).unsqueeze(1), 0)
    return to_e4m3(x_kept, scales.index_select(0, seg_M)), scales, seg_M


def scales_to_ue8m0(scales: Tensor) -> Tensor:
    """Power-of-two float32 scales -> their biased exponent as uint8 (2^(byte - 127)); an Inf
    or NaN scale (a non-finite block) -> 255, E8M0's NaN. Only for power-of-two scales
    (pow2_ceil's, 2^-126 .. 2^120: bytes 1 .. 247; not checked: that would read the device)."""
    _, exp = torch.frexp(scales)
    byte = exp - 1 + 127
    return torch.where(torch.isfinite(scales), byte, UE8M0_NONFINITE).to(torch.uint8)


def ue8m0_to_scales(byte: Tensor) -> Tensor:
    """uint8 biased exponents -> float32 scales 2^(byte - 127). Byte 255 (non-finite) reads as
    2^128 = Inf: its block's codes are 0 or NaN, so the block dequantizes to NaN."""
    exp = byte.to(torch.int32) - 127
    return torch.ldexp(torch.ones(exp.shape, device=byte.device), exp)


class _FakeQuant(torch.autograd.Function):
    """dequantize(quantize(x)) in x's dtype; straight-through gradient (identity)."""

    @staticmethod
    def forward(ctx, x: Tensor, block: int, pow2: bool, floor: float) -> Tensor:
        if block == 0:
            return dequantize(*quantize_along(x, -1, pow2, floor), x.dtype)
        q, scales = quantize_blocks(x, block, pow2, floor)
        return dequantize_blocks(q, scales, block, x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


def fake_quant_rows(x: Tensor, pow2: bool = False, floor: float = AMAX_FLOOR) -> Tensor:
    """Rowwise e4m3 round trip with a straight-through gradient."""
    return _FakeQuant.apply(x, 0, pow2, floor)


def fake_quant_blocks(
    x: Tensor, block: int = 128, pow2: bool = False, floor: float = AMAX_FLOOR
) -> Tensor:
    """1 x block e4m3 round trip with a straight-through gradient."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return _FakeQuant.apply(x, block, pow2, floor)
