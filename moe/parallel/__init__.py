"""Expert x data parallelism on a DeviceMesh, applied from outside the model, and the memory
features for very large models (grouped optimizer apply, CPU offload, checkpoints)."""

from moe.parallel.mesh import dense_parameters, expert_parameters, init_mesh, is_expert_parameter
from moe.parallel.parallelize import parallelize
from moe.parallel.checkpoint import load_checkpoint, save_checkpoint
from moe.parallel.checkpointing import auto_checkpoint
from moe.parallel.clip import clip_grad_norm_
from moe.parallel.grouped_apply import GroupedApply
from moe.parallel.planner import MemoryPlan, plan
from moe.parallel.precision import LossScaler
