"""Moved (2026-12-07): moe/memory/estimate.py, activations.py and model_counts.py. This module
only forwards the names moe.plan.stages imports until its import line moves too."""

from moe.memory.activations import activation_bytes, block_activation_bytes
from moe.memory.estimate import GiB, MemoryPlan, plan_memory
from moe.memory.model_counts import PlannerModel, count_parameters

__all__ = [
    "GiB",
    "MemoryPlan",
    "PlannerModel",
    "activation_bytes",
    "block_activation_bytes",
    "count_parameters",
    "plan_memory",
]
