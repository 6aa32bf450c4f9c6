"""How token rows travel between ranks, as one object a dispatcher holds (`RowWire`, built once
from the layer's FP8Config by `row_wire`): the dispatch and combine exchanges with their
backwards, and the per-direction row formats the overlapped dispatcher's chunked exchanges use.
Nothing on the dispatch path branches on FP8: it calls the wire it was given.

- plain (no FP8Config, or neither dispatch nor grad_before_down_fp8): rows in their dtype,
  moe.comm.exchange both ways; in one process nothing happens.
- FP8: the dispatch sends e4m3 + 1 x block scales forward (FP8Config.dispatch), the combine's
  backward sends the gradient before the down-projection in FP8 (grad_before_down_fp8); the
  other two directions stay in the rows' dtype. Gradients pass the quantizer straight through.

One process (LocalDispatcher) emulates the wire: `local_dispatch` / `local_combine` run the same
quantize -> pack -> unpack -> dequantize on the token rows with an exchange that stays here
(`SAME_PLACE`), so a layer computes the same function at every expert-parallel layout.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from moe.comm.alltoall import exchange
from moe.fp8.config import FP8Config
from moe.fp8.payload import (
    dequantize_payload,
    fp8_combine,
    fp8_dispatch,
    pack_rows,
    quantize_payload,
    scale_bytes,
    unpack_rows,
)


class _SamePlace:
    """An exchange plan that moves nothing (one process): run(rows) is rows."""

    def run(self, x_ND: Tensor) -> Tensor:
        return x_ND

    def reverse(self) -> "_SamePlace":
        return self


SAME_PLACE = _SamePlace()


@dataclass(frozen=True)
class RowFormat:
    """The rows of one direction on the wire: in their dtype (fp8 None) or as e4m3 bytes plus
    scales packed in one uint8 row (moe.fp8.payload)."""

    fp8: FP8Config | None = None

    def encode(self, x_ND: Tensor) -> Tensor:
        if self.fp8 is None:
            return x_ND.contiguous()
        c = self.fp8
        q_ND, s_NB = quantize_payload(x_ND, c.block_size, c.scale_format, c.amax_floor)
        return pack_rows(q_ND, s_NB, c.scale_format)

    def decode(self, payload_NP: Tensor, D: int, dtype: torch.dtype) -> Tensor:
        """The received rows [N, D] in dtype (the sender's)."""
        if self.fp8 is None:
            return payload_NP
        c = self.fp8
        q_ND, s_NB = unpack_rows(payload_NP, D, c.scale_format)
        return dequantize_payload(q_ND, s_NB, c.block_size, dtype)

    def row_bytes(self, D: int, element_size: int) -> int:
        if self.fp8 is None:
            return D * element_size
        return D + scale_bytes(D, self.fp8.block_size, self.fp8.scale_format)


PLAIN = RowFormat()


@dataclass(frozen=True)
class RowWire:
    """The four directions' formats (dispatch, its backward, combine, its backward) and the
    exchanges that use them. fp8: the FP8Config they come from (None: plain)."""

    fp8: FP8Config | None = None

    def _on(self, flag: bool) -> RowFormat:
        return RowFormat(self.fp8) if flag else PLAIN

    @property
    def dispatch_format(self) -> RowFormat:
        return self._on(self.fp8 is not None and self.fp8.dispatch)

    @property
    def combine_grad_format(self) -> RowFormat:
        return self._on(self.fp8 is not None and self.fp8.grad_before_down_fp8)

    combine_format = PLAIN  # the combine forward and the dispatch backward: the rows' dtype
    dispatch_grad_format = PLAIN

    def dispatch(self, x_ND: Tensor, plan) -> Tensor:
        """x's rows exchanged by plan (autograd-aware), in the dispatch format."""
        if self.fp8 is None:
            return exchange(x_ND.contiguous(), plan)
        return fp8_dispatch(x_ND, plan, self.fp8)

    def combine(self, y_ND: Tensor, plan) -> Tensor:
        """The experts' output rows exchanged home by plan; backward in the combine-gradient
        format."""
        if self.fp8 is None:
            return exchange(y_ND.contiguous(), plan)
        return fp8_combine(y_ND, plan, self.fp8)

    def local_dispatch(self, x_TD: Tensor) -> Tensor:
        """One process: x's token rows as the dispatch exchange would deliver them."""
        return x_TD if self.fp8 is None else fp8_dispatch(x_TD, SAME_PLACE, self.fp8)

    def local_combine(self, y_RD: Tensor) -> Tensor:
        """One process: the expert rows as the combine exchange would deliver them (forward
        unchanged; the backward quantized with grad_before_down_fp8)."""
        return y_RD if self.fp8 is None else fp8_combine(y_RD, SAME_PLACE, self.fp8)

    @property
    def quantizes_combine_grad(self) -> bool:
        """The combine's backward is quantized per expert row: the rows must reach the
        combine unweighted (the weighted sum after it), as they do between ranks."""
        return self.fp8 is not None and self.fp8.grad_before_down_fp8


def fp8_on_the_wire(fp8: FP8Config | None) -> bool:
    """Whether these settings change what the exchange sends (dispatch or its combine grad)."""
    return fp8 is not None and (fp8.dispatch or fp8.grad_before_down_fp8)


def row_wire(fp8: FP8Config | None) -> RowWire:
    """The wire of a layer with MoEConfig.fp8 = fp8: plain unless FP8 touches the exchange."""
    return RowWire(fp8) if fp8_on_the_wire(fp8) else RowWire()
