"""The weight format of a layer with MoEConfig.quirks, around whichever format stores the
experts' weights (dense, or LoRA's with its adapters: QuirkFormat `wraps`): those weights, plus
the up projection's bias b3 [E, F] where the family has one (a parameter of the experts, dim 0
the expert: expert parallelism, FSDP2, spare slots and checkpoints treat it as they treat b1),
plus the family's experts module that computes the rest (QuirkWeights.family: its gate or
activation and its post-expert norm; moe.interop.hf_contract hands it to the experts as
`experts.family`)."""

import functools
import math
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.weight_format import DENSE, WeightFormat, register_weight_format
from moe.quirks.config import Quirks
from moe.shards import local


@dataclass(frozen=True, eq=False)
class QuirkWeights(ExpertWeights):
    """ExpertWeights (w1: the gate columns, w3: the up columns, b1 / b2: their biases) + b3_LF,
    the up bias, sliced and flattened with them; `family`: the module whose function, in the
    family's own code, runs between the GEMMs (not a tensor slot)."""

    b3_LF: torch.Tensor | None = None
    family: nn.Module = field(default=None)
    quirks: Quirks = field(default=None)


@functools.cache
def weights_class(inner: type) -> type:
    """QuirkWeights over the inner format's weights type (its fields kept: LoRA's adapters)."""
    if inner is ExpertWeights:
        return QuirkWeights
    cls = type(f"Quirk{inner.__name__}", (inner, QuirkWeights), {"__module__": __name__})
    return dataclass(frozen=True, eq=False)(cls)


@dataclass(frozen=True)
class QuirkFormat(WeightFormat):
    """config: the layer's Quirks (MoEConfig.quirks; `claims` returns the instance); inner:
    the format that stores the weights (`around`)."""

    config: Quirks | None = None
    inner: WeightFormat = DENSE
    selected_by = "MoEConfig.quirks"
    wraps = True

    def claims(self, config) -> "QuirkFormat | None":
        return None if config.quirks is None else QuirkFormat(self.name, config.quirks)

    def around(self, inner: WeightFormat) -> "QuirkFormat":
        return QuirkFormat(self.name, self.config, inner)

    def setup(self, experts: nn.Module) -> None:
        """The inner format's setup; b3 (the up bias, initialised like b1) when the family has
        one and the experts do not hold it yet (a format set again keeps it)."""
        self.inner.setup(experts)
        if not self.config.up_bias or "b3" in experts._parameters:
            return
        if experts.w3 is None or experts.b1 is None:
            raise ValueError("Quirks.up_bias needs gated experts with biases (swiglu, bias=True)")
        experts.b3 = nn.Parameter(torch.empty_like(experts.b1))
        if experts.b3.device.type != "meta":
            bound = 1.0 / math.sqrt(experts.d_model)
            nn.init.uniform_(experts.b3, -bound, bound)

    def weights(self, experts: nn.Module) -> QuirkWeights:
        family = getattr(experts, "family", None)
        if family is None:
            raise ValueError(
                "MoEConfig.quirks: these experts hold no family module to compute with "
                "(layers with quirks are built by moe.from_hf)"
            )
        inner = self.inner.weights(experts)
        return weights_class(type(inner))(
            **{f.name: getattr(inner, f.name) for f in fields(inner)},
            b3_LF=local(experts.b3) if self.config.up_bias else None,
            family=family[0],
            quirks=self.config,
        )


QUIRKS = register_weight_format(QuirkFormat("quirks"))
