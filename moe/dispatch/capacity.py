"""Alias module, kept for one release: capacity moved to `moe.capacity` (shared with
moe.gating). Import `moe.dispatch.expert_capacity` / `moe.dispatch.capacity_factor_for` (their
public path); each name here warns."""

from moe._moved import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "capacity_factor_for": "moe.dispatch.capacity_factor_for",
        "expert_capacity": "moe.dispatch.expert_capacity",
        "count_ids": "moe.capacity.count_ids",
    },
)
