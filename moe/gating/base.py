"""Routing result, router base class and the registry of routers by name."""

import math
from dataclasses import dataclass

import torch
from torch import nn

ROUTERS: dict[str, type["Router"]] = {}


def router_matmul(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """x @ w^T in float32 (float64 for float64 inputs), autocast off: under bf16 autocast the
    router's matmul would otherwise run in bf16 and change which experts tokens choose."""
    dtype = torch.promote_types(x_TD.dtype, torch.float32)
    device_type = x_TD.device.type if x_TD.device.type in ("cpu", "cuda", "xpu") else "cpu"
    with torch.autocast(device_type, enabled=False):
        return x_TD.to(dtype) @ w_ED.to(dtype).t()


def register_router(name: str):
    """Class decorator: make a router constructible by `MoEConfig(router=name)`."""

    def add(cls):
        ROUTERS[name] = cls
        return cls

    return add


@dataclass
class Routing:
    """What a router decides for T tokens over E experts (all fp32).

    Token choice fills expert_ids_TK / weights_TK (and mask_TK when the router itself declines
    some pairs); expert choice fills token_ids_EC / weights_EC instead.
    """

    logits_TE: torch.Tensor
    probs_TE: torch.Tensor  # scores used for metrics (entropy)
    aux_loss: torch.Tensor  # already weighted by the config's coefficients
    expert_ids_TK: torch.Tensor | None = None
    weights_TK: torch.Tensor | None = None
    mask_TK: torch.Tensor | None = None
    token_ids_EC: torch.Tensor | None = None
    weights_EC: torch.Tensor | None = None


class Router(nn.Module):
    """Linear scorer `weight` [E, d_model] in fp32 math; subclasses pick experts from logits."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.d_model))
        self.reset_parameters()

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError for options this router cannot honour."""

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.config.d_model)
        nn.init.uniform_(self.weight, -bound, bound)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return router_matmul(x_TD, self.weight)

    replayable = True  # picks top-k experts per token: moe.replay_routing can force them

    @classmethod
    def forced_ids_problem(cls, config, expert_ids_TK: torch.Tensor) -> str | None:
        """Why `expert_ids_TK` cannot be forced on this router (None if it can). Reads values:
        for moe.replay_routing's checks before replay starts, never in a forward."""
        if expert_ids_TK.numel() and not (
            (expert_ids_TK >= 0).all() and (expert_ids_TK < config.num_experts).all()
        ):
            return f"an expert id is outside [0, {config.num_experts})"
        return None

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: torch.Tensor | None = None) -> Routing:
        """Route T tokens. `forced_ids_TK` (router replay) replaces the top-k choice; the
        weights are still the router's own scores at those experts, normalised as usual."""
        raise NotImplementedError
