"""FP8 MoE training (issue 40), the numerics core: settings, e4m3 quantizers, the FP8 dispatch
payload and exchange, the FP8 grouped GEMM and the FP8 expert MLP. Self-contained: it imports
only moe.kernels and moe.comm leaf modules and the leaf moe.fp8.config, never moe.layer,
moe.parallel, moe.gating, moe.dispatch or moe.config (tests/test_layering.py).

Where it plugs in (the layer / registries do the wiring):
- expert kernel: `fp8_expert_mlp(x_ND, offsets_L, w1, w2, w3, b1, b2, *, activation, rows,
  config)`, the contract of moe.kernels.torch_expert_mlp.expert_mlp_torch plus an FP8Config;
  fuses the combine (rows.sum_to_tokens) like the torch kernel.
- exchange: `fp8_dispatch(x_ND, plan, config, grad_fp8=False)` for the dispatch direction and
  `fp8_combine(y_ND, plan, config)` for the combine direction, where plan is a
  moe.comm.AllToAllPlan (anything with .run(rows) and .reverse()); each replaces
  moe.comm.exchange(x, plan) in its direction.
- settings: `FP8Config` (MoEConfig.fp8; defined in the leaf moe/fp8/config.py), checked across
  ranks by `moe.fp8.config.agree_across_ranks` and by parallelize's config check.
- wiring (issue 40): moe/fp8/kernel.py registers the "fp8" expert kernel (FP8Kernel; a layer
  with fp8.experts runs one holding its FP8Config); moe/fp8/wire.py is the row exchange every
  dispatcher holds (RowWire: plain, or FP8 in the directions FP8Config asks for).
"""

from moe.fp8.config import FP8Config, agree_across_ranks
from moe.fp8.expert_mlp import fp8_expert_mlp
from moe.fp8.grouped_mm import fp8_grouped_mm
from moe.fp8.kernel import FP8Kernel
from moe.fp8.payload import fp8_combine, fp8_dispatch, pack_rows, unpack_rows

__all__ = [
    "FP8Config",
    "FP8Kernel",
    "agree_across_ranks",
    "fp8_combine",
    "fp8_dispatch",
    "fp8_expert_mlp",
    "fp8_grouped_mm",
    "pack_rows",
    "unpack_rows",
]
