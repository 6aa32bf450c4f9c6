"""How long is the path of one token? Trace one plain MoELayer forward and count its steps.

    PYTHONPATH=. python -m tools.token_path            # the three numbers
    PYTHONPATH=. python -m tools.token_path --list     # and the files and functions, in order

The layer: `moe.MoELayer(64, 128, 8, backend="torch")` on CPU in training mode, one forward of
[4, 16, 64] float32 inputs with grad enabled, after one untraced forward (so one-time work,
such as resolving the kernel or importing a format, is not counted). Only the forward is
traced, not the backward.

What is counted, from `sys.setprofile`'s Python "call" events whose code lives in a file under
the package directory (`moe/`; C functions and torch's own Python are not counted):
- functions: distinct code objects called (file, first line, name); a function called many
  times counts once.
- files: distinct files those functions live in.
- returns to a file already left: take the file of every call event in order, merge
  consecutive calls in the same file into one visit; each visit to a file that had an earlier
  visit counts one. `layer -> experts -> layer -> experts` is 2: the reader of the code goes
  back to a file they already read, once per count.
"""

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TokenPath:
    """What one traced call did: its calls (file, function) in order, under `root`."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    @property
    def functions(self) -> list[str]:
        """Distinct functions ("file:name"), in first-call order."""
        return list(dict.fromkeys(f"{f}:{n}" for f, n in self.calls))

    @property
    def files(self) -> list[str]:
        """Distinct files, in first-call order."""
        return list(dict.fromkeys(f for f, _ in self.calls))

    @property
    def visits(self) -> list[str]:
        """The files of the calls in order, consecutive calls in one file merged."""
        return [f for i, (f, _) in enumerate(self.calls) if i == 0 or self.calls[i - 1][0] != f]

    @property
    def returns(self) -> int:
        """Visits to a file that had an earlier visit (the module docstring's definition)."""
        seen: set[str] = set()
        count = 0
        for f in self.visits:
            count += f in seen
            seen.add(f)
        return count


def trace(fn: Callable[[], object], root: str) -> TokenPath:
    """Run fn() under sys.setprofile and keep the calls of Python functions in files under
    `root` (a directory), named relative to root's parent."""
    root = os.path.abspath(root) + os.sep
    base = os.path.dirname(root.rstrip(os.sep))
    path = TokenPath()
    names: dict = {}  # code object -> (file, name), or None outside root

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        entry = names.get(code, False)
        if entry is False:
            file = os.path.abspath(code.co_filename)
            entry = None
            if file.startswith(root):
                rel = os.path.relpath(file, base)
                entry = (rel, f"{getattr(code, 'co_qualname', code.co_name)}@{code.co_firstlineno}")
            names[code] = entry
        if entry is not None:
            path.calls.append(entry)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return path


def measure_layer() -> TokenPath:
    """The plain layer's forward (the module docstring's setup)."""
    import torch

    import moe

    torch.manual_seed(0)
    layer = moe.MoELayer(64, 128, 8, backend="torch")
    x = torch.randn(4, 16, 64, requires_grad=True)
    layer(x)  # warm-up: one-time resolution is not the path
    return trace(lambda: layer(x), os.path.dirname(moe.__file__))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the files and functions")
    args = parser.parse_args(argv)
    path = measure_layer()
    if args.list:
        print("visits:", " -> ".join(path.visits))
        for name in path.functions:
            print(" ", name)
    print(f"functions {len(path.functions)}  files {len(path.files)}  returns {path.returns}")


if __name__ == "__main__":
    main(sys.argv[1:])
