"""The FP8 row format on the wire: e4m3 bytes plus 1 x block scales packed in one uint8 row
(moe/fp8/payload.py), registered as the row format "fp8" and chosen by the layer's FP8Config
(MoEConfig.fp8), never by name:

- FP8Config.dispatch: the dispatched token rows go in FP8 (DeepEP's format);
- FP8Config.grad_before_down_fp8: the combine's backward (the activation gradient before the
  down-projection) goes in FP8, as DeepSeek-V3 does.
The other two directions stay in the rows' dtype. With FP8Config.experts too, the dispatched
rows arrive as QuantizedRows (moe/fp8/rows.py): the codes and scales as they came, read by the
FP8 expert GEMMs without a dequantize (every other op sees the decoded rows). Everything else
(the exchanges, their backwards, the one-process emulation) is the generic wire's
(moe/dispatch/wire.py).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from moe.dispatch.wire import PLAIN, RowFormat, RowWire, register_row_format
from moe.fp8.config import FP8Config
from moe.fp8.payload import dequantize_payload, encode_rows, scale_bytes, unpack_rows
from moe.fp8.rows import QuantizedRows


@dataclass(frozen=True)
class FP8Rows(RowFormat):
    """Rows as e4m3 + block scales with the settings of `fp8` (block size, scale format, amax
    floor). The registered instance (fp8 None) only claims directions for a layer."""

    fp8: FP8Config | None = None
    to_experts: bool = False  # decode to QuantizedRows (the FP8 experts read the codes)
    selected_by = "MoEConfig.fp8 (FP8Config(dispatch=True) / grad_before_down_fp8=True)"

    def encode(self, x_ND: Tensor) -> Tensor:
        c = self.fp8
        return encode_rows(x_ND, c.block_size, c.scale_format, c.amax_floor)

    def decode(self, payload_NP: Tensor, D: int, dtype: torch.dtype) -> Tensor:
        c = self.fp8
        q_ND, s_NB = unpack_rows(payload_NP, D, c.scale_format)
        if self.to_experts and not torch.compiler.is_compiling():  # (compiled: decoded rows)
            return QuantizedRows(
                q_ND, s_NB, c.block_size, c.pow2_dispatch_scales, c.amax_floor, dtype
            )  # fmt: skip
        return dequantize_payload(q_ND, s_NB, c.block_size, dtype)

    def row_bytes(self, D: int, element_size: int) -> int:
        return D + scale_bytes(D, self.fp8.block_size, self.fp8.scale_format)

    def claims(self, config) -> dict[str, RowFormat]:
        c = config.fp8
        if c is None:
            return {}
        rows = FP8Rows(self.name, c)
        on = {"dispatch": c.dispatch, "combine_grad": c.grad_before_down_fp8}
        chosen = {direction: rows for direction, flag in on.items() if flag}
        if c.dispatch and c.experts:
            chosen["dispatch"] = FP8Rows(self.name, c, to_experts=True)
        return chosen


FP8_ROWS = register_row_format(FP8Rows("fp8"))


def fp8_dispatch(x_ND: Tensor, plan, config: FP8Config | None, grad_fp8: bool = False) -> Tensor:
    """The dispatch exchange: FP8 on the wire when config.dispatch (else x's dtype; config
    None: x's dtype both ways); the gradient goes home in the gradient's dtype, or in FP8
    with grad_fp8."""
    if config is None and grad_fp8:
        raise ValueError("fp8_dispatch: grad_fp8=True needs an FP8Config, got None")
    rows = FP8Rows(FP8_ROWS.name, config)
    fwd = rows if config is not None and config.dispatch else PLAIN
    return RowWire(dispatch_format=fwd, dispatch_grad_format=rows if grad_fp8 else PLAIN).dispatch(
        x_ND, plan
    )


def fp8_combine(y_ND: Tensor, plan, config: FP8Config | None) -> Tensor:
    """The combine exchange: y's dtype forward; its backward (the gradient before the experts'
    down-projection) in FP8 when config.grad_before_down_fp8 (config None: y's dtype)."""
    on = config is not None and config.grad_before_down_fp8
    rows = FP8Rows(FP8_ROWS.name, config) if on else PLAIN
    return RowWire(combine_grad_format=rows).combine(y_ND, plan)
