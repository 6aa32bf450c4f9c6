"""Memory features for very large models: group-wise optimizer apply, CPU offload, mixed
precision with loss scaling, activation recompute, and the per-device memory planner.

Public names (one path each, the README's): GroupedApply, LossScaler, recompute_blocks,
plan_memory, MemoryPlan.
"""

from moe.memory.grouped_apply import GroupedApply
from moe.memory.planner import MemoryPlan, PlannerModel, plan_memory
from moe.memory.precision import LossScaler
from moe.memory.recompute import recompute_blocks

__all__ = [
    "GroupedApply",
    "LossScaler",
    "MemoryPlan",
    "PlannerModel",
    "plan_memory",
    "recompute_blocks",
]
