"""The allowed values of MoEConfig's string options, and the router registry.

Why here: MoEConfig validates these names, and the stages that implement them (moe.gating,
moe.kernels) use them too. Defined in either stage, config.py would import a stage for a
list of names (an arrow from the options to their implementations). This module imports
nothing from moe, so config, gating and kernels all import it; routers fill ROUTERS by
`register_router` when moe.gating is imported (moe/__init__.py imports it first).
"""

from collections.abc import Sequence

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu")  # moe.kernels.activations
GATED_ACTIVATIONS = ("swiglu",)  # activations with a second (w3) projection
BALANCE_LOSSES = ("batch", "sequence", "global")  # moe.gating.balance
SEQUENCE_ROUTERS = ("topk", "switch")  # routers whose balance term is E * sum_i f_i P_i
SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("position", "probs")

ROUTERS: dict[str, type] = {}  # name -> Router subclass (moe.gating.base.Router)
KERNELS: dict[str, object] = {}  # name -> ExpertKernel (moe.kernels.registry.register_kernel)


class _KernelNames(Sequence):
    """The values of MoEConfig.backend: "auto", then every registered expert kernel, read live
    (a kernel registered after import, e.g. by a user's module, is a valid value at once)."""

    def _names(self) -> tuple[str, ...]:
        return ("auto", *KERNELS)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        return name == "auto" or name in KERNELS

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._names())


BACKENDS = _KernelNames()  # "auto" + the expert kernels (moe.kernels.registry)


def register_router(name: str):
    """Class decorator: make a router constructible by `MoEConfig(router=name)`."""

    def add(cls):
        ROUTERS[name] = cls
        return cls

    return add
