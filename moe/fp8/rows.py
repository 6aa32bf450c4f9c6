"""Dispatched rows that stay e4m3 until the FP8 expert GEMMs read them (issue 61): DeepEP's FP8
payload feeding the GEMM without a dequantize / requantize round trip.

`QuantizedRows` is a tensor subclass (torchao's way: the number format is the tensor's type, so
no dispatcher, layer or kernel registry names it): rows [N, D] in the sender's dtype, held as
the wire's e4m3 codes (uint8) and 1 x block float32 scales. The FP8 row format's decode
returns one when the layer's FP8 experts consume the dispatched rows (moe/fp8/wire.py). Ops
that only move rows keep them quantized: index_select and x[ids] (the dispatchers'
permutations) record which stored rows they read, no copy (the requantizing launch reads
through them); slices, split, cat, detach and clone move codes and scales. Every other op sees
the rows dequantized exactly as the wire's decode writes them (decoded once, then shared), so
any other consumer (a LoRA adapter, a custom dispatcher, ...) computes today's values with
today's one decode. In-place writes into it are refused (the rows are a value, not storage).
Gradients flow as plain tensors.

`gemm_input` is the FP8 expert kernel's x operand (moe/fp8/expert_mlp_fn.py):
- the recipes agree (blockwise GEMM scales, dispatch block_size 128, both scales powers of two:
  scale_format "pow2" / "ue8m0" with gemm_scale_format "pow2", and the same amax floor): the
  codes and scales as they arrived. Their values code x scale equal those of quantizing the
  decoded rows bit for bit (a power-of-two scale makes every decoded value exact in float32,
  bf16 and float16; where a block's largest code rounded to 224 the GEMM's own quantization
  picks half the scale and twice the codes: the same products), so every GEMM, kept operand and
  gradient is the same (tests/test_fp8_rows.py);
- otherwise (rowwise, fp32 scales on either side, another block size): quantized again from
  the codes, on CUDA in ONE launch (moe/fp8/triton_requant.py; the same codes and scales as
  quantizing the decoded rows), elsewhere the decode and the GEMM's quantization (the eager
  chain, today's).
"""

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

from moe.fp8.blockwise import BLOCK
from moe.fp8.grouped_mm import quantize_input
from moe.fp8.payload import dequantize_payload
from moe.kernels.triton_kernel import triton_installed

aten = torch.ops.aten


class QuantizedRows(torch.Tensor):
    """Rows [N, D] of `dtype` held as e4m3 codes (uint8 [S, D]) and 1 x `block` float32 scales
    [S, ceil(D / block)] made with power-of-two scales (`pow2`) and amax floor `floor`; rows_N
    (int64, optional): the stored rows these rows are, in order (a row permutation or gather
    not yet applied: the requantizing launch reads through it, no copy of the codes)."""

    @staticmethod
    def __new__(cls, codes, scales, block, pow2, floor, dtype, rows_N=None):
        # the device of the codes' storage (a stand-in may report another one to Python:
        # bench/budget_device.py; `device` below answers what the codes answer)
        device = torch._C.TensorBase.device.__get__(codes)
        N = codes.shape[0] if rows_N is None else rows_N.shape[0]
        return Tensor._make_wrapper_subclass(
            cls, (N, codes.shape[1]), dtype=dtype, device=device, requires_grad=False
        )

    def __init__(self, codes, scales, block, pow2, floor, dtype, rows_N=None):
        self.codes, self.scales, self.rows_N = codes, scales, rows_N
        self.block, self.pow2, self.floor = block, pow2, floor
        self._decoded = None  # the decoded rows, made once for all the ops that need them

    @property
    def device(self):
        return self.codes.device

    @property
    def is_cuda(self):
        return self.codes.is_cuda

    def __repr__(self):
        return f"QuantizedRows(shape={tuple(self.shape)}, dtype={self.dtype}, block={self.block})"

    def __tensor_flatten__(self):
        names = ["codes", "scales"] + ([] if self.rows_N is None else ["rows_N"])
        return names, (self.block, self.pow2, self.floor, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return QuantizedRows(inner["codes"], inner["scales"], *meta, inner.get("rows_N"))

    def _like(self, codes: Tensor, scales: Tensor, rows_N=None) -> "QuantizedRows":
        return QuantizedRows(codes, scales, self.block, self.pow2, self.floor, self.dtype, rows_N)

    def _reading(self, rows_N: Tensor) -> "QuantizedRows":
        return self._like(self.codes, self.scales, rows_N)

    def stored(self) -> tuple[Tensor, Tensor]:
        """(codes, scales) of these rows in order (gathered through rows_N where set)."""
        if self.rows_N is None:
            return self.codes, self.scales
        return self.codes.index_select(0, self.rows_N), self.scales.index_select(0, self.rows_N)

    def dequantize(self) -> Tensor:
        """The rows as the wire's decode writes them (FP8Rows.decode without experts), made
        once: every op that reads them (e.g. a LoRA adapter's and the base GEMMs) shares them,
        as it shared the rows decoded on arrival."""
        if self._decoded is None:
            self._decoded = dequantize_payload(*self.stored(), self.block, self.dtype)
        return self._decoded

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        move = _ROW_MOVES.get(func)
        if move is not None:
            out = move(*args, **kwargs)
            if out is not None:
                return out
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            raise RuntimeError(f"QuantizedRows: {func} writes into FP8 dispatch rows (read-only)")
        plain = tree_map_only(QuantizedRows, QuantizedRows.dequantize, (args, kwargs))
        return func(*plain[0], **plain[1])


def _along_rows(x, dim) -> bool:
    return dim in (0, -2) and x.dim() == 2


def _index_select(x, dim, index):
    if _along_rows(x, dim):  # no copy: the rows read through the index
        return x._reading(index if x.rows_N is None else x.rows_N.index_select(0, index))
    return None


def _index(x, indices):
    """x[ids] with one integer index tensor (rows): as index_select."""
    ids = indices[0] if len(indices) == 1 else None
    if ids is not None and ids.dim() == 1 and ids.dtype in (torch.int64, torch.int32):
        return _index_select(x, 0, ids)
    return None


def _slice(x, dim=0, start=None, end=None, step=1):
    if _along_rows(x, dim):
        if x.rows_N is not None:
            return x._reading(x.rows_N[start:end:step])
        return x._like(x.codes[start:end:step], x.scales[start:end:step])
    return None


def _cat(tensors, dim=0):
    parts = list(tensors)
    first = parts[0]
    same = all(
        isinstance(t, QuantizedRows)
        and (t.block, t.pow2, t.floor, t.dtype, t.shape[1:])
        == (first.block, first.pow2, first.floor, first.dtype, first.shape[1:])
        for t in parts
    )
    if _along_rows(first, dim) and same:
        codes, scales = zip(*(t.stored() for t in parts))
        return first._like(torch.cat(codes), torch.cat(scales))
    return None


def _split(x, split_size, dim=0):
    if _along_rows(x, dim):
        if x.rows_N is not None:
            return [x._reading(r) for r in x.rows_N.split(split_size)]
        pieces = zip(x.codes.split(split_size), x.scales.split(split_size))
        return [x._like(c, s) for c, s in pieces]
    return None


_ROW_MOVES = {
    aten.index_select.default: _index_select,
    aten.index.Tensor: _index,
    aten.slice.Tensor: _slice,
    aten.cat.default: _cat,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.detach.default: lambda x: x._like(x.codes, x.scales, x.rows_N),
    aten.clone.default: lambda x, memory_format=None: x._like(*(t.clone() for t in x.stored())),
}


def agrees(x: QuantizedRows, pow2: bool, floor: float, recipe: str) -> bool:
    """x's codes and scales are the GEMM's x operand as they are (see the module docstring)."""
    return recipe == "blockwise" and x.block == BLOCK and x.pow2 and pow2 and x.floor == floor


def gemm_input(
    x_ND: Tensor, pow2: bool, floor: float, recipe: str, gathered: bool = False
) -> tuple[Tensor, Tensor]:
    """x's (e4m3 bytes as uint8, scales) in the recipe's scaling, as quantize_input makes them
    from the rows x reads as (see the module docstring). gathered: the caller reads the rows
    through a row index (a gather makes them contiguous), so codes as they arrived may stay a
    row-strided view of the payload (no copy); scales are contiguous."""
    if not isinstance(x_ND, QuantizedRows):
        return quantize_input(x_ND, pow2, floor, recipe)
    if agrees(x_ND, pow2, floor, recipe):
        codes, scales = x_ND.stored()
        return (codes if gathered else codes.contiguous()), scales.contiguous()
    D = x_ND.shape[1]
    width = D if recipe == "rowwise" else BLOCK
    if x_ND.codes.is_cuda and D % width == 0 and triton_installed():
        from moe.fp8.triton_requant import requantize_triton

        return requantize_triton(
            x_ND.codes, x_ND.scales, x_ND.block, x_ND.dtype, width, pow2, floor, x_ND.rows_N
        )  # fmt: skip
    return quantize_input(x_ND.dequantize(), pow2, floor, recipe)


def plain(x_ND: Tensor) -> Tensor:
    """x as an ordinary tensor (its decoded rows when it is QuantizedRows)."""
    return x_ND.dequantize() if isinstance(x_ND, QuantizedRows) else x_ND
