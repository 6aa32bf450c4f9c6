"""Weight formats (a registry): how GroupedExperts store their weights and hand them to a kernel.

A format is a `WeightFormat`: `setup(experts)` runs once when a layer's experts are built (it
may convert the stored weights or add tensors of its own as parameters or buffers of the
experts module, dim 0 the expert, so expert parallelism shards them with the weights and state
dicts carry them), and `weights(experts)` builds the ExpertWeights a kernel gets at each call
(the local shards; a stored-quantized format dequantizes here, or tags `format=` and `scales`
for a kernel that reads them: ExpertKernel.formats). DENSE keeps plain weights.

A new format is one file: a subclass and `register_weight_format(MyFormat("name"))`;
`MoEConfig(weight_format="name")` selects it. A feature whose own settings choose its format
overrides `claims(config)` (the hook every registry entry has) and sets `selected_by`; a
number format that quantizes inside its GEMMs needs none (its masters stay dense). A claimed
format that only adds tensors of its own beside whatever format stores the weights sets
`wraps` and implements `around(inner)`: it is applied around the format otherwise chosen.
"""

from dataclasses import dataclass

from torch import nn

from moe.kernels.expert_weights import DENSE as DENSE_NAME
from moe.kernels.expert_weights import ExpertWeights
from moe.names import WEIGHT_FORMAT_NAMES, WEIGHT_FORMATS, claimed, register
from moe.shards import local


@dataclass(frozen=True)
class WeightFormat:
    """How the experts store weights and what a kernel gets. The base is the dense format.

    selected_by: the setting that chooses this format when a feature's settings do; then
    `claims` returns the format (holding those settings) for a layer that asks for it, and
    MoEConfig(weight_format=name) is refused (one setting chooses it)."""

    name: str
    selected_by = None  # class attribute: None, or the setting that chooses it (see above)
    wraps = False  # class attribute: True for a format applied around another (`around`)

    def claims(self, config) -> "WeightFormat | None":
        """The format a layer with MoEConfig `config` must use because its settings ask for
        it; None (the default): the settings do not (weight_format names the format)."""
        return None

    def around(self, inner: "WeightFormat") -> "WeightFormat":
        """This format around `inner` (a format that `wraps`): its setup and weights call
        inner's and add its own."""
        raise NotImplementedError

    def setup(self, experts: nn.Module) -> None:
        """Once, when the experts are built (weights initialised): convert or add tensors."""

    def weights(self, experts: nn.Module) -> ExpertWeights:
        """This rank's expert weights as the kernel reads them (local shards of DTensors)."""
        return ExpertWeights(
            w1_LDF=local(experts.w1),
            w2_LFD=local(experts.w2),
            w3_LDF=local(experts.w3),
            b1_LF=local(experts.b1),
            b2_LD=local(experts.b2),
        )


def register_weight_format(fmt: WeightFormat) -> WeightFormat:
    """Make `fmt` selectable as MoEConfig(weight_format=fmt.name); returns it."""
    if not isinstance(fmt, WeightFormat):
        raise TypeError(f"register_weight_format takes a WeightFormat, got {type(fmt).__name__}")
    return register(WEIGHT_FORMATS, fmt, "weight format")


DENSE = register_weight_format(WeightFormat(DENSE_NAME))


def weight_format_for(config) -> WeightFormat:
    """The format of a layer with MoEConfig `config`: the one its settings claim (`claims`),
    which config.weight_format must leave "dense"; else the registered one it names. Claimed
    formats that `wrap` are applied around that one, in registration order."""
    named = WEIGHT_FORMATS.get(config.weight_format)
    if named is None:
        raise ValueError(
            f"weight_format={config.weight_format!r} is not one of {WEIGHT_FORMAT_NAMES}"
        )
    formats = claimed(WEIGHT_FORMATS, config)
    fmt = _stored_format(named, [f for f in formats if not f.wraps])
    for outer in (f for f in formats if f.wraps):
        fmt = outer.around(fmt)
    return fmt


def _stored_format(named: WeightFormat, formats: list) -> WeightFormat:
    """The format that stores the weights: the one claimed (at most one), else `named`."""
    if len(formats) > 1:
        raise ValueError(f"weight formats {[f.name for f in formats]} each claim this layer")
    if formats:
        if named is not DENSE:
            raise ValueError(
                f"{formats[0].selected_by} stores the experts' weights as {formats[0].name!r}, "
                f"but weight_format={named.name!r} asks for another format"
            )
        return formats[0]
    if named.selected_by is not None:
        raise ValueError(
            f"weight_format={named.name!r} is chosen by {named.selected_by}, not by name"
        )
    return named
