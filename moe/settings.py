"""The one module that reads the environment (imports nothing from moe), with one parser.

Every setting has one declared home, a field of a typed config: `moe.comm.ExchangeConfig` (the
all-to-all; `moe.parallel.parallelize(..., exchange=)` takes it) and `moe.kernels.KernelConfig`
(the Triton kernels; `moe.kernels.set_kernel_config`). One precedence for every field:

    a value given in code  >  its environment variable  >  the default

The variable is read once, when the config is built (`ExchangeConfig()`, which `parallelize`
builds when given none; the process's KernelConfig when a kernel first asks, or after
`set_kernel_config(None)`), never when the setting is used, so a variable changed later (on one
rank) changes nothing. `read` parses every variable: it names the variable, accepts the
spellings the README's "Environment variables" table lists and refuses the rest: integers in
decimal digits up to int64's largest (leading zeros allowed), paths as written (not stripped;
too long for the file system: refused naming the variable). A `MOE_*` variable that is none of
these (in any case) is warned about once per process, naming the known ones (a misspelling is
not ignored silently); a known name in another case (moe_ranks_per_node) is a ValueError
naming it when its config is built.
`LOCAL_WORLD_SIZE`, `WORLD_SIZE`, `LOCAL_RANK` (torchrun's) and `TRITON_INTERPRET` (Triton's)
are read here too.
"""

import difflib
import os
import re
import warnings

TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")
MAX_INT = 2**63 - 1  # int64: the largest integer a setting takes
PATH_MAX = 4096  # Linux's PATH_MAX: longer paths are refused before the file system sees them
NAME_MAX = 255  # the longest name of one path component

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
    what it accepts. Surrounding spaces are ignored, except in a path (a file name may hold
    them); flags in any case; integers in decimal digits (leading zeros allowed) up to int64's
    largest."""
    if kind == "path":
        check_path(name, text)
        return text
    value = text.strip()
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
    if not re.fullmatch(r"[0-9]+", value) or not low <= int(value) <= MAX_INT:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise ValueError(f"{name}={shown!r} is not an integer >= {low} and <= {MAX_INT} (int64)")
    return int(value)


def check_path(name: str, text: str) -> None:
    """A path the file system can take: not too long as a whole or in one component, no NUL;
    else a ValueError naming `name` (a variable, or a config field given a path in code)."""
    shown = text if len(text) <= 60 else f"{text[:60]}... ({len(text)} characters)"
    if "\0" in text:
        raise ValueError(f"{name}={shown!r} is not a path: it holds a NUL character")
    if len(os.fsencode(text)) >= PATH_MAX:
        raise ValueError(f"{name}={shown!r} is not a path: longer than {PATH_MAX - 1} bytes")
    longest = max(len(os.fsencode(part)) for part in text.split("/"))
    if longest > NAME_MAX:
        raise ValueError(
            f"{name}={shown!r} is not a path: a component longer than {NAME_MAX} bytes"
        )


_warned: set[str] = set()  # unknown MOE_* names already warned about (once per process)


def warn_unknown() -> None:
    """Warn once per name about a MOE_* variable this library does not read (a misspelling
    would otherwise be ignored silently), naming the closest known one and every known one."""
    known = sorted(ENV.values())
    for name in sorted(os.environ):
        # any case: a lowercase moe_* name is as easy to mean; one spelling a known name in
        # another case is refused by `read` instead
        if not name.upper().startswith("MOE_") or name.upper() in known or name in _warned:
            continue
        _warned.add(name)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.warn(
            f"{name} is not a setting of moe and is ignored{hint}; the known ones are "
            f"{', '.join(known)}",
            UserWarning,
            stacklevel=3,
        )


def read(key: str) -> bool | int | str | None:
    """The parsed value of the variable that overrides the field `key` ("Config.field"), read
    now; None when unset (empty counts as unset). Configs call it when they are built."""
    warn_unknown()
    name = ENV[key]
    other_case = sorted(n for n in os.environ if n != name and n.upper() == name)
    if other_case:  # variable names are case-sensitive: the value would be ignored
        raise ValueError(
            f"{other_case[0]} is set, but the variable is {name} (names are case-sensitive): "
            f"rename it to {name} or unset it"
        )
    text = os.environ.get(name, "")
    if not text.strip():
        return None
    return parse(name, KIND[key], text)


def local_world_size() -> str | None:
    """torchrun's LOCAL_WORLD_SIZE (ranks on this node), as text; None when unset."""
    return os.environ.get("LOCAL_WORLD_SIZE") or None


def torchrun_ranks() -> tuple[int, int]:
    """(WORLD_SIZE, LOCAL_RANK) as torchrun sets them; (1, 0) when unset (one process)."""
    return int(os.environ.get("WORLD_SIZE") or 1), int(os.environ.get("LOCAL_RANK") or 0)


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its CPU interpreter (for Tritons without
    `triton.knobs`; newer ones are asked directly)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
