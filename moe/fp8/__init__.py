"""FP8 MoE training (issue 40), one package: settings, e4m3 quantizers, the FP8 row format on the
wire, the FP8 grouped GEMM and the FP8 expert kernel. It plugs into the registries (a row format
and an expert kernel, both chosen by MoEConfig.fp8) and imports only moe.kernels, moe.comm and
moe.dispatch.wire; nothing outside it names it, and a layer without FP8 never loads it
(tests/test_layering.py). Importing it registers its entries (`from moe.fp8 import FP8Config`
does; so does a MoEConfig given an fp8 value).

What it provides:
- expert kernel: `fp8_expert_mlp(x_ND, offsets_L, w1, w2, w3, b1, b2, *, activation, rows,
  config)`, the contract of moe.kernels.torch_expert_mlp.expert_mlp_torch plus an FP8Config;
  fuses the combine (rows.sum_to_tokens) like the torch kernel.
- exchange: `fp8_dispatch(x_ND, plan, config, grad_fp8=False)` for the dispatch direction and
  `fp8_combine(y_ND, plan, config)` for the combine direction, where plan is a
  moe.comm.AllToAllSplits (anything with .run(rows) and .reverse()); each replaces
  moe.comm.exchange(x, plan) in its direction (the generic wire with the FP8 row format).
- weights: their e4m3 forms are made once per optimizer step and reused by every micro-batch
  (moe/fp8/weight_cache.py); `weights_changed()` drops them after a `.data` write made between
  the micro-batches of one step (every other change to a weight is seen by itself).
- settings: `FP8Config` (MoEConfig.fp8, moe/fp8/config.py), checked across ranks by
  `agree_across_ranks` and, as part of MoEConfig, by parallelize's config check.
- registrations: moe/fp8/kernel.py the "fp8" expert kernel (FP8Kernel; a layer with
  fp8.experts runs one holding its FP8Config); moe/fp8/wire.py the "fp8" row format (FP8Rows;
  the directions FP8Config asks for).
"""

from moe.fp8.config import FP8Config, agree_across_ranks
from moe.fp8.expert_mlp import fp8_expert_mlp
from moe.fp8.grouped_mm import fp8_grouped_mm
from moe.fp8.kernel import FP8Kernel
from moe.fp8.payload import pack_rows, unpack_rows
from moe.fp8.weight_cache import weights_changed
from moe.fp8.wire import FP8Rows, fp8_combine, fp8_dispatch

__all__ = [
    "FP8Config",
    "FP8Kernel",
    "FP8Rows",
    "agree_across_ranks",
    "fp8_combine",
    "fp8_dispatch",
    "fp8_expert_mlp",
    "fp8_grouped_mm",
    "pack_rows",
    "unpack_rows",
    "weights_changed",
]
