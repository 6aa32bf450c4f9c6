"""FP8 MoE training (issue 40), the numerics core: settings, e4m3 quantizers, the FP8 dispatch
payload and exchange, the FP8 grouped GEMM and the FP8 expert MLP. Self-contained: the layer,
the kernel registry and the dispatchers plug these in (they import nothing from moe.layer or
moe.parallel)."""

from moe.fp8.config import FP8Config
from moe.fp8.expert_mlp import fp8_expert_mlp
from moe.fp8.grouped_mm import fp8_grouped_mm
from moe.fp8.payload import fp8_combine, fp8_dispatch, pack_rows, unpack_rows

__all__ = [
    "FP8Config",
    "fp8_combine",
    "fp8_dispatch",
    "fp8_expert_mlp",
    "fp8_grouped_mm",
    "pack_rows",
    "unpack_rows",
]
