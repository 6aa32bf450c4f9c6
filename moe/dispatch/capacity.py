"""Alias module, kept for one release: capacity moved to `moe.capacity` (shared with
moe.gating). Import `moe.dispatch.expert_capacity` / `moe.dispatch.capacity_factor_for`, or
`moe.capacity` directly."""

from moe.capacity import capacity_factor_for, count_ids, expert_capacity

__all__ = ["capacity_factor_for", "count_ids", "expert_capacity"]
