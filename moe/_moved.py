"""Old public paths kept until a stated version: a package's `__getattr__` that warns and
forwards.

    __getattr__ = moved_names(__name__, {"plan": "moe.memory.plan_memory"})

makes `moe.memory.plan` (attribute access or `from moe.memory import plan`) return
`moe.memory.plan_memory` with a DeprecationWarning naming the new path. Policy: an alias names
the version that removes it, and is removed when that version is reached (the "until 0.1"
aliases went in 0.1.0). The README lists each public name's one path; CHANGELOG.md lists the
moves and the removals.
"""

import importlib
import warnings


def moved_names(module: str, aliases: dict[str, str]):
    """A module-level `__getattr__` resolving `aliases` (old name -> new dotted path)."""

    def __getattr__(name: str):
        target = aliases.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in the next release: use {target}",
            DeprecationWarning,
            stacklevel=2,
        )
        owner, _, attr = target.rpartition(".")
        return getattr(importlib.import_module(owner), attr)

    return __getattr__
