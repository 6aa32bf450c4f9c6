"""Weight formats (a registry): how GroupedExperts store their weights and hand them to a kernel.

A format is a `WeightFormat`: `setup(experts)` runs once when a layer's experts are built (it
may convert the stored weights or add tensors of its own as parameters or buffers of the
experts module, dim 0 the expert, so expert parallelism shards them with the weights and state
dicts carry them), and `weights(experts)` builds the ExpertWeights a kernel gets at each call
(the local shards; a stored-quantized format dequantizes here, or tags `format=` and `scales`
for a kernel that reads them: ExpertKernel.formats). DENSE keeps plain weights.

A new format is one file: a subclass and `register_weight_format(MyFormat("name"))`;
`MoEConfig(weight_format="name")` selects it. FP8 training needs none (its masters stay dense;
the FP8 kernel quantizes inside each GEMM).
"""

from dataclasses import dataclass

from torch import nn

from moe.kernels.expert_weights import DENSE as DENSE_NAME
from moe.kernels.expert_weights import ExpertWeights
from moe.names import WEIGHT_FORMAT_NAMES, WEIGHT_FORMATS, register
from moe.shards import local


@dataclass(frozen=True)
class WeightFormat:
    """How the experts store weights and what a kernel gets. The base is the dense format."""

    name: str

    def for_config(self, config) -> "WeightFormat":
        """The format a layer with MoEConfig `config` uses (a format with settings of its own,
        e.g. moe.lora's adapters, returns an instance holding them); the default: itself."""
        return self

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
    """The registered format MoEConfig `config` names (config.weight_format)."""
    fmt = WEIGHT_FORMATS.get(config.weight_format)
    if fmt is None:
        raise ValueError(
            f"weight_format={config.weight_format!r} is not one of {WEIGHT_FORMAT_NAMES}"
        )
    return fmt.for_config(config)
