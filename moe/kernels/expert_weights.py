"""ExpertWeights: one layer's local expert weights as one value (a leaf: the kernels, the
experts module and the dispatchers import it, it imports nothing from moe).

Why a type and not a (w1, w2, w3, b1, b2) tuple: a weight format with scales (FP8: per-row
or per-block scales beside each matrix) or another layout adds fields here and a kernel that
reads them; nothing between the experts module and the kernel changes. Low-rank adapters
(moe.lora) ride along the same way: `adapters` by name ("A_w1", "B_w1", ...), each [L, ...],
with their scale and input dropout; every kernel adds them through one function
(moe/kernels/adapted_mlp.py, called by ExpertKernel.__call__).
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
    # low-rank adapters by name: A_<w> [L, in, r], B_<w> [L, r, out] for w in w1, w2, w3;
    # the MLP adds adapter_scale * dropout(x) @ A @ B (dropout p = adapter_dropout) to x @ W
    adapters: dict[str, torch.Tensor] = field(default_factory=dict)
    adapter_scale: float = 1.0
    adapter_dropout: float = 0.0

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
        """Every tensor slot in a fixed order (the weights, the scales by name, the adapters by
        name): the flat form an autograd.Function takes (`with_tensors` is its inverse)."""
        mats = tuple(getattr(self, f.name) for f in fields(self) if f.name not in _META)
        scales = tuple(self.scales[k] for k in sorted(self.scales))
        return mats + scales + tuple(self.adapters[k] for k in sorted(self.adapters))

    def with_tensors(self, tensors) -> "ExpertWeights":
        """The same weights with every tensor slot replaced, in `tensors()` order."""
        names = [f.name for f in fields(self) if f.name not in _META]
        tensors = tuple(tensors)
        mats = dict(zip(names, tensors[: len(names)]))
        rest = tensors[len(names) :]
        scales = dict(zip(sorted(self.scales), rest[: len(self.scales)]))
        adapters = dict(zip(sorted(self.adapters), rest[len(self.scales) :]))
        return replace(self, **mats, scales=scales, adapters=adapters)

    def map(self, fn) -> "ExpertWeights":
        """fn applied to every present tensor (None slots stay None)."""
        return self.with_tensors(None if t is None else fn(t) for t in self.tensors())

    def slice(self, first: int, n: int) -> "ExpertWeights":
        """Local experts [first, first + n): for a dispatcher that computes experts in parts."""
        return self.map(lambda t: t[first : first + n])


_META = ("scales", "format", "adapters", "adapter_scale", "adapter_dropout")
