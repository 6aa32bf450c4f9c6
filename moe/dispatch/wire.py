"""How token rows travel between ranks: row formats (a registry) and the wire of one layer.

A row format (`RowFormat`) says how rows of one direction go on the wire: `encode` rows
[N, D] into a payload [N, P] that any exchange moves as rows (moe.comm's plans send rows of
any dtype), `decode` it on arrival back to [N, D] in the sender's dtype, and `row_bytes` (what
the all-to-all cost model counts). PLAIN sends the rows as they are. A new format is one file:
a subclass and `register_row_format(MyRows("name"))`; `MoEConfig(row_format="name")` sends the
dispatched token rows in it. A feature whose own settings choose its formats (e.g. a number
format package with its own settings field in MoEConfig) overrides `claims` instead and sets
`selected_by`.

`RowWire` is the four directions of one layer (dispatch, its backward, combine, its backward)
and the exchanges that use them; every dispatcher holds one (`wire_for(config)`, built once
from the layer's MoEConfig) and calls it, so nothing on the dispatch path names a format.
Gradients pass a format straight through (the decoded rows' gradient is the rows' gradient).

One process (LocalDispatcher) emulates the wire: `local_dispatch` / `local_combine` encode and
decode the rows with an exchange that stays here (`SAME_PLACE`), so a layer computes the same
function at every expert-parallel layout.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from moe.comm.alltoall import exchange
from moe.names import ROW_FORMAT_NAMES, ROW_FORMATS, register

DIRECTIONS = ("dispatch", "dispatch_grad", "combine", "combine_grad")


@dataclass(frozen=True)
class RowFormat:
    """Rows of one direction on the wire. The base is the plain format: the rows as they are.

    selected_by: the setting that chooses this format when a feature's settings do (a MoEConfig
    settings field); then `MoEConfig(row_format=name)` is refused, and `claims` says which
    directions the settings give it."""

    name: str
    selected_by = None  # class attribute: None, or the setting that chooses it (see above)

    @property
    def plain(self) -> bool:
        """The rows go as they are (encode / decode do nothing): exchanges skip them."""
        return type(self) is RowFormat

    def encode(self, x_ND: Tensor) -> Tensor:
        """rows [N, D] -> payload rows [N, P] (any dtype) that an exchange moves as they are."""
        return x_ND.contiguous()

    def decode(self, payload_NP: Tensor, D: int, dtype: torch.dtype) -> Tensor:
        """payload rows [N, P] -> rows [N, D] in dtype (the sender's)."""
        return payload_NP

    def row_bytes(self, D: int, element_size: int) -> int:
        """Bytes one row of width D (elements of element_size bytes) takes on the wire."""
        return D * element_size

    def claims(self, config) -> dict[str, "RowFormat"]:
        """The directions this format carries for a layer with MoEConfig `config`: by default
        the dispatched token rows when config.row_format names it."""
        return {"dispatch": self} if config.row_format == self.name and not self.plain else {}


def register_row_format(fmt: RowFormat) -> RowFormat:
    """Make `fmt` selectable as MoEConfig(row_format=fmt.name) (or claimable by its settings)."""
    if not isinstance(fmt, RowFormat):
        raise TypeError(f"register_row_format takes a RowFormat, got {type(fmt).__name__}")
    return register(ROW_FORMATS, fmt, "row format")


PLAIN = register_row_format(RowFormat("plain"))


class _SamePlace:
    """An exchange plan that moves nothing (one process): run(rows) is rows."""

    def run(self, x_ND: Tensor) -> Tensor:
        return x_ND

    def reverse(self) -> "_SamePlace":
        return self


SAME_PLACE = _SamePlace()


def send_rows(x_ND: Tensor, plan, fmt: RowFormat) -> Tensor:
    """x's rows exchanged by plan (anything with .run(rows)) in fmt, decoded to x's dtype on
    arrival. No autograd."""
    if fmt.plain:
        return plan.run(x_ND.contiguous())
    return fmt.decode(plan.run(fmt.encode(x_ND)), x_ND.shape[1], x_ND.dtype)


class _Exchange(torch.autograd.Function):
    """y = exchange(x) by plan in format fwd; the backward goes by plan.reverse() in format
    bwd, straight through the formats."""

    @staticmethod
    def forward(ctx, x_ND, plan, fwd: RowFormat, bwd: RowFormat):
        ctx.plan, ctx.bwd = plan, bwd
        return send_rows(x_ND, plan, fwd)

    @staticmethod
    def backward(ctx, grad_MD):
        return send_rows(grad_MD.contiguous(), ctx.plan.reverse(), ctx.bwd), None, None, None


@dataclass(frozen=True)
class RowWire:
    """The four directions' formats of one layer and the exchanges that use them."""

    dispatch_format: RowFormat = PLAIN
    dispatch_grad_format: RowFormat = PLAIN
    combine_format: RowFormat = PLAIN
    combine_grad_format: RowFormat = PLAIN

    @property
    def formats(self) -> tuple[RowFormat, ...]:
        """The four directions' formats, in DIRECTIONS order."""
        return (
            self.dispatch_format,
            self.dispatch_grad_format,
            self.combine_format,
            self.combine_grad_format,
        )

    @property
    def plain(self) -> bool:
        """Every direction plain: the rows travel as they are. (A property, not a
        functools.cached_property: Python 3.11's takes an RLock, a graph break under compile.)"""
        return all(fmt.plain for fmt in self.formats)

    def dispatch(self, x_ND: Tensor, plan) -> Tensor:
        """x's rows exchanged by plan (autograd-aware) in the dispatch formats."""
        return self._exchange(x_ND, plan, self.dispatch_format, self.dispatch_grad_format)

    def combine(self, y_ND: Tensor, plan) -> Tensor:
        """The experts' output rows exchanged home by plan, in the combine formats."""
        return self._exchange(y_ND, plan, self.combine_format, self.combine_grad_format)

    def local_dispatch(self, x_TD: Tensor) -> Tensor:
        """One process: x's token rows as the dispatch exchange would deliver them."""
        return self._local(x_TD, self.dispatch_format, self.dispatch_grad_format)

    def local_combine(self, y_RD: Tensor) -> Tensor:
        """One process: the expert rows as the combine exchange would deliver them."""
        return self._local(y_RD, self.combine_format, self.combine_grad_format)

    @staticmethod
    def _exchange(x_ND: Tensor, plan, fwd: RowFormat, bwd: RowFormat) -> Tensor:
        if fwd.plain and bwd.plain:
            return exchange(x_ND.contiguous(), plan)
        return _Exchange.apply(x_ND, plan, fwd, bwd)

    @staticmethod
    def _local(x_ND: Tensor, fwd: RowFormat, bwd: RowFormat) -> Tensor:
        return x_ND if fwd.plain and bwd.plain else _Exchange.apply(x_ND, SAME_PLACE, fwd, bwd)


PLAIN_WIRE = RowWire()


def wire_for(config) -> RowWire:
    """The wire of a layer with MoEConfig `config`: each direction in the format that claims it
    (MoEConfig.row_format's for the dispatched rows; a feature's settings for theirs), plain
    where none does. Two formats claiming one direction, or a settings-chosen format asked for
    by name, is a ValueError naming them."""
    named = ROW_FORMATS.get(config.row_format)
    if config.row_format not in ROW_FORMAT_NAMES or named is None:
        raise ValueError(f"row_format={config.row_format!r} is not one of {ROW_FORMAT_NAMES}")
    if named.selected_by is not None:
        raise ValueError(
            f"row_format={config.row_format!r} is chosen by {named.selected_by}, not by name"
        )
    chosen: dict[str, RowFormat] = {}
    for fmt in list(ROW_FORMATS.values()):
        for direction, claimed in fmt.claims(config).items():
            if direction in chosen:
                raise ValueError(
                    f"row formats {chosen[direction].name!r} and {claimed.name!r} both claim "
                    f"the {direction} rows"
                )
            chosen[direction] = claimed
    return RowWire(**{f"{d}_format": f for d, f in chosen.items()})
