"""Memory features for very large models: group-wise optimizer apply, CPU offload, mixed
precision with loss scaling, activation recompute, and the per-device memory planner."""

from moe.memory.grouped_apply import GroupedApply
from moe.memory.planner import MemoryPlan, PlannerModel, plan
from moe.memory.precision import LossScaler
from moe.memory.recompute import auto_checkpoint
