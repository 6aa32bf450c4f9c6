"""Routers, registered by name, and their losses."""

from moe.gating import expert_choice, gshard, noisy, prototype, topk  # noqa: F401  (registers)
from moe.gating.base import Router, Routing
from moe.names import ROUTERS, register_router
from moe.gating.balance import (
    BalanceTracker,
    GlobalBalance,
    reset_global_balance,
    sequence_balance_loss,
)
from moe.gating.losses import balance_term, cv_squared, load_balance_loss, z_loss


def build_router(config) -> Router:
    return ROUTERS[config.router](config)


__all__ = [
    "BalanceTracker",
    "GlobalBalance",
    "ROUTERS",
    "Router",
    "Routing",
    "balance_term",
    "build_router",
    "cv_squared",
    "load_balance_loss",
    "register_router",
    "reset_global_balance",
    "sequence_balance_loss",
    "z_loss",
]
