"""Memory features for very large models: group-wise optimizer apply, CPU offload, mixed
precision with loss scaling, activation recompute, and the per-device memory estimate.

Public names (one path each, the README's): GroupedApply, LossScaler, recompute_blocks,
find_repeated_blocks, estimate_memory, MemoryEstimate (plan_memory, MemoryPlan: their names
before 2026-12-07, kept one release).
"""

from moe.memory.grouped_apply import GroupedApply
from moe.memory.estimate import MemoryEstimate, MemoryPlan, estimate_memory, plan_memory
from moe.memory.model_counts import PlannerModel
from moe.memory.precision import LossScaler
from moe.memory.recompute import find_repeated_blocks, recompute_blocks

__all__ = [
    "GroupedApply",
    "LossScaler",
    "MemoryEstimate",
    "MemoryPlan",
    "PlannerModel",
    "find_repeated_blocks",
    "estimate_memory",
    "plan_memory",
    "recompute_blocks",
]
