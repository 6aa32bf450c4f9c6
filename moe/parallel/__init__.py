"""Expert x data parallelism on a DeviceMesh, applied from outside the model.

The memory features (moe.memory) and checkpoint I/O (moe.checkpoint) are re-exported here
under their public names.
"""

from moe.parallel.mesh import dense_parameters, expert_parameters, init_mesh, is_expert_parameter
from moe.parallel.parallelize import parallelize
from moe.parallel.clip import clip_grad_norm_
from moe.parallel.placement import Placement, plan_placement
from moe.parallel.rebalance import RebalanceReport, rebalance_experts
from moe.memory import GroupedApply, LossScaler, MemoryPlan, auto_checkpoint, plan
from moe.checkpoint import load_checkpoint, save_checkpoint
