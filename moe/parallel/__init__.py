"""Expert x data parallelism on a DeviceMesh, applied from outside the model, and the memory
features for very large models (grouped optimizer apply, CPU offload, checkpoints)."""

from moe.parallel.mesh import dense_parameters, expert_parameters, init_mesh, is_expert_parameter
from moe.parallel.parallelize import parallelize
