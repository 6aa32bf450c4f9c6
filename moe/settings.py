"""The one module that reads the environment (imports nothing from moe).

Every setting has a declared home, a field of a typed config: `moe.comm.ExchangeConfig` (the
all-to-all; `moe.parallel.parallelize(..., exchange=)` takes it) and `moe.kernels.KernelConfig`
(the Triton kernels; `moe.kernels.set_kernel_config`). An environment variable only overrides
one field, and is read here at the moment the setting is used (tests and benchmarks change some
while a process runs). The README's "Environment variables" table lists them.
`LOCAL_WORLD_SIZE` (torchrun's) and `TRITON_INTERPRET` (Triton's) are read here too.
"""

import os

_OFF = ("0", "false", "off", "no")

# "Config.field" -> the environment variable that overrides it
ENV = {
    "KernelConfig.autotune": "MOE_TRITON_AUTOTUNE",
    "KernelConfig.tma": "MOE_TRITON_TMA",
    "ExchangeConfig.overlap_cuda_stream": "MOE_OVERLAP_CUDA_STREAM",
    "ExchangeConfig.cost_profile": "MOE_A2A_COST_PROFILE",
    "ExchangeConfig.hierarchical_max_bytes": "MOE_A2A_HIERARCHICAL_MAX_BYTES",
    "ExchangeConfig.pipeline_min_bytes": "MOE_A2A_PIPELINE_MIN_BYTES",
    "ExchangeConfig.ranks_per_node": "MOE_RANKS_PER_NODE",
}


def override(key: str) -> str | None:
    """The text of the variable that overrides the field `key` ("Config.field"), read now;
    None when unset (empty counts as unset)."""
    return os.environ.get(ENV[key]) or None


def flag_override(key: str) -> bool | None:
    """A boolean field's override: MOE_TRITON_AUTOTUNE is off for 0/false/off/no and on
    otherwise; the others are on only for "1". None when unset."""
    raw = override(key)
    if raw is None:
        return None
    if key == "KernelConfig.autotune":
        return raw.strip().lower() not in _OFF
    return raw == "1"


def local_world_size() -> str | None:
    """torchrun's LOCAL_WORLD_SIZE (ranks on this node), as text; None when unset."""
    return os.environ.get("LOCAL_WORLD_SIZE")


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its CPU interpreter (for Tritons without
    `triton.knobs`; newer ones are asked directly)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
