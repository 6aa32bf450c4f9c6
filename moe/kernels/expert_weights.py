"""ExpertWeights: one layer's local expert weights as one value (a leaf: the kernels, the
experts module and the dispatchers import it, it imports nothing from moe).

Why a type and not a (w1, w2, w3, b1, b2) tuple: a weight format with scales (per-row or
per-block scales beside each matrix) puts them in `scales` and a kernel reads them; a feature
whose weights carry more tensors subclasses it in its own package (its kernel wrapper reads
them). Nothing between the experts module and the kernel changes: the tensor slots are found
from the fields (a tensor, None, or a dict of tensors by name), so `tensors`, `slice` and
`map` carry a subclass's tensors too.
"""

from dataclasses import dataclass, field, fields, replace

import torch

DENSE = "dense"  # the format tag of plain floating-point weights (every dtype the kernel takes)


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """The L local experts' weights: w1_LDF, w2_LFD (+ w3_LDF for gated activations), optional
    biases b1_LF, b2_LD, and for a scaled format its scales by name (each [L, ...]: dim 0 is
    the expert, so `slice` cuts them with the weights). `format` says how to read the tensors
    ("dense": the values themselves); a kernel declares the formats it takes."""

    w1_LDF: torch.Tensor
    w2_LFD: torch.Tensor
    w3_LDF: torch.Tensor | None = None
    b1_LF: torch.Tensor | None = None
    b2_LD: torch.Tensor | None = None
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    format: str = DENSE

    @property
    def num_experts(self) -> int:
        return self.w1_LDF.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.w1_LDF.dtype

    @property
    def device(self) -> torch.device:
        return self.w1_LDF.device

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor slot in field order (a dict field's tensors by sorted name): the flat
        form an autograd.Function takes (`with_tensors` is its inverse)."""
        out: list[torch.Tensor | None] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                out += [value[k] for k in sorted(value)]
            elif value is None or isinstance(value, torch.Tensor):
                out.append(value)
        return tuple(out)

    def with_tensors(self, tensors) -> "ExpertWeights":
        """The same weights with every tensor slot replaced, in `tensors()` order."""
        it = iter(tuple(tensors))
        changes = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                changes[f.name] = {k: next(it) for k in sorted(value)}
            elif value is None or isinstance(value, torch.Tensor):
                changes[f.name] = next(it)
        return replace(self, **changes)

    def map(self, fn) -> "ExpertWeights":
        """fn applied to every present tensor (None slots stay None)."""
        return self.with_tensors(None if t is None else fn(t) for t in self.tensors())

    def slice(self, first: int, n: int) -> "ExpertWeights":
        """Local experts [first, first + n): for a dispatcher that computes experts in parts."""
        return self.map(lambda t: t[first : first + n])
