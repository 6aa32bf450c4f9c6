"""Quirks: what a transformers family's experts compute beyond moe's plain expert MLP, declared
as data read from the family's experts module (moe.interop.hf_contract builds it), one typed,
validated value. MoEConfig.quirks holds it; a layer with it runs the experts as the family does
(moe/quirks/kernel.py). Plain JSON values, so checkpoints record and compare it."""

from dataclasses import dataclass

FUNCTIONS = ("_apply_gate", "act_fn")  # gated: the module's gate on [gate | up]; not gated


@dataclass(frozen=True, kw_only=True)
class Quirks:
    """experts_class: "module.Qualname" of the family's experts class, whose function runs
    between the two GEMMs (the module itself is held by the layer: its scalars and
    parameter-free activation modules, and its post_expert_norm).
    function: "_apply_gate" (gated experts: the module's own gate on the up GEMM's output, gate
    and up columns in the module's order) or "act_fn" (experts without a gate).
    interleaved: gate and up columns alternate (g0 u0 g1 u1 ..., GPT-OSS), else gate ones first.
    up_bias: the up projection has a bias (experts.b3, [E, F]; gated experts with biases).
    post_norm: the module's post_expert_norm runs on each expert output row, before the
    combine weight scales it.
    scalars: the module's plain attributes (name, value), recorded: what its function reads."""

    experts_class: str
    function: str
    interleaved: bool = False
    up_bias: bool = False
    post_norm: bool = False
    scalars: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        if not isinstance(self.experts_class, str) or not self.experts_class:
            raise ValueError(
                f"Quirks.experts_class must be a class path, got {self.experts_class!r}"
            )
        if self.function not in FUNCTIONS:
            raise ValueError(f"Quirks.function must be one of {FUNCTIONS}, got {self.function!r}")
        for name in ("interleaved", "up_bias", "post_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Quirks.{name} must be a bool, got {getattr(self, name)!r}")
        gated = self.function == "_apply_gate"
        if not gated and (self.interleaved or self.up_bias):
            raise ValueError("Quirks.interleaved and up_bias need gated experts (_apply_gate)")
        scalars = tuple(tuple(pair) for pair in self.scalars)  # (lists from JSON)
        if any(len(p) != 2 or not isinstance(p[0], str) for p in scalars):
            raise ValueError(f"Quirks.scalars must be (name, value) pairs, got {self.scalars!r}")
        object.__setattr__(self, "scalars", scalars)
