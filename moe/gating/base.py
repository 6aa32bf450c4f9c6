"""Routing result, router base class and the registry of routers by name."""

import math
from dataclasses import dataclass

import torch
from torch import nn

ROUTERS: dict[str, type["Router"]] = {}


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
        dtype = torch.promote_types(x_TD.dtype, torch.float32)  # fp32 or wider (float64)
        return x_TD.to(dtype) @ self.weight.to(dtype).t()

    def forward(self, x_TD: torch.Tensor) -> Routing:
        raise NotImplementedError
