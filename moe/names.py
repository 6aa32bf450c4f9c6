"""The allowed values of MoEConfig's string options, and the router registry.

Why here: MoEConfig validates these names, and the stages that implement them (moe.gating,
moe.kernels) use them too. Defined in either stage, config.py would import a stage for a
list of names (an arrow from the options to their implementations). This module imports
nothing from moe, so config, gating and kernels all import it; routers fill ROUTERS by
`register_router` when moe.gating is imported (moe/__init__.py imports it first).
"""

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu")  # moe.kernels.activations
GATED_ACTIVATIONS = ("swiglu",)  # activations with a second (w3) projection
BACKENDS = ("auto", "torch", "triton")  # expert kernels (moe.kernels.expert_mlp)
BALANCE_LOSSES = ("batch", "sequence", "global")  # moe.gating.balance
SEQUENCE_ROUTERS = ("topk", "switch")  # routers whose balance term is E * sum_i f_i P_i
SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("position", "probs")

ROUTERS: dict[str, type] = {}  # name -> Router subclass (moe.gating.base.Router)


def register_router(name: str):
    """Class decorator: make a router constructible by `MoEConfig(router=name)`."""

    def add(cls):
        ROUTERS[name] = cls
        return cls

    return add
