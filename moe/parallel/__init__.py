"""Expert x data parallelism on a DeviceMesh, applied from outside the model: the mesh,
parallelize, gradient clipping, and load-aware expert placement.

Public names (one path each, the README's): init_mesh, parallelize, ParallelConfig,
clip_grad_norm_,
rebalance_experts, RebalanceReport, choose_placement, Placement, choose_replicas,
ReplicaPlacement, sum_replica_grads, expert_parameters,
dense_parameters, is_expert_parameter. The memory features live in moe.memory and checkpoint
I/O in moe.checkpoint.
"""

from moe.experts import dense_parameters, expert_parameters, is_expert_parameter
from moe.parallel.mesh import init_mesh
from moe.parallel.parallel_config import ParallelConfig
from moe.parallel.parallelize import parallelize
from moe.parallel.clip import clip_grad_norm_
from moe.slots.placement import Placement, choose_placement, plan_placement
from moe.parallel.rebalance import RebalanceReport, rebalance_experts
from moe.slots.replica_placement import ReplicaPlacement, choose_replicas, plan_replicas
from moe.parallel.replicas import sum_replica_grads

__all__ = [
    "ParallelConfig",
    "Placement",
    "RebalanceReport",
    "ReplicaPlacement",
    "clip_grad_norm_",
    "dense_parameters",
    "expert_parameters",
    "init_mesh",
    "is_expert_parameter",
    "parallelize",
    "choose_placement",
    "choose_replicas",
    "plan_placement",
    "plan_replicas",
    "rebalance_experts",
    "sum_replica_grads",
]
