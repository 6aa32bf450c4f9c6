"""The one module that reads the environment (imports nothing from moe), with one parser.

Every setting has one declared home, a field of a typed config: `moe.comm.ExchangeConfig` (the
all-to-all; `moe.parallel.parallelize(..., exchange=)` takes it) and `moe.kernels.KernelConfig`
(the Triton kernels; `moe.kernels.set_kernel_config`). One precedence for every field:

    a value given in code  >  its environment variable  >  the default

The variable is read once, when the config is built (`ExchangeConfig()`, which `parallelize`
builds when given none; the process's KernelConfig when a kernel first asks, or after
`set_kernel_config(None)`), never when the setting is used, so a variable changed later (on one
rank) changes nothing. `read` parses every variable: it names the variable, accepts the
spellings the README's "Environment variables" table lists and refuses the rest.
`LOCAL_WORLD_SIZE` (torchrun's) and `TRITON_INTERPRET` (Triton's) are read here too.
"""

import os
import re

TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")
MAX_DIGITS = 19  # int64

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
# "Config.field" -> what its variable holds: "flag", "bytes" (int >= 0), "count" (int >= 1), "path"
KIND = {
    "KernelConfig.autotune": "flag",
    "KernelConfig.tma": "flag",
    "ExchangeConfig.overlap_cuda_stream": "flag",
    "ExchangeConfig.cost_profile": "path",
    "ExchangeConfig.hierarchical_max_bytes": "bytes",
    "ExchangeConfig.pipeline_min_bytes": "bytes",
    "ExchangeConfig.ranks_per_node": "count",
}


def parse(name: str, kind: str, text: str) -> bool | int | str:
    """The value of variable `name` holding `text`, or a ValueError naming the variable and
    what it accepts. Surrounding spaces are ignored; flags in any case."""
    value = text.strip()
    if kind == "path":
        return value
    if kind == "flag":
        if value.lower() in TRUE:
            return True
        if value.lower() in FALSE:
            return False
        raise ValueError(
            f"{name}={text!r} is not a flag: use one of {', '.join(TRUE)} (on) or "
            f"{', '.join(FALSE)} (off)"
        )
    low = 1 if kind == "count" else 0
    if not re.fullmatch(rf"[0-9]{{1,{MAX_DIGITS}}}", value) or int(value) < low:
        raise ValueError(f"{name}={text!r} is not an integer >= {low}")
    return int(value)


def read(key: str) -> bool | int | str | None:
    """The parsed value of the variable that overrides the field `key` ("Config.field"), read
    now; None when unset (empty counts as unset). Configs call it when they are built."""
    name = ENV[key]
    text = os.environ.get(name, "")
    if not text.strip():
        return None
    return parse(name, KIND[key], text)


def local_world_size() -> str | None:
    """torchrun's LOCAL_WORLD_SIZE (ranks on this node), as text; None when unset."""
    return os.environ.get("LOCAL_WORLD_SIZE") or None


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its CPU interpreter (for Tritons without
    `triton.knobs`; newer ones are asked directly)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
