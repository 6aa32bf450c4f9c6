"""The argument checks of `python -m moe.plan` and `python -m moe.plan profile`: a number within
its bounds (argparse types) and a file to write, each refused with one line before any work."""

from __future__ import annotations

import argparse
import os

from moe.settings import check_path


def bounded(kind, low, high, *, open_low: bool = True):
    """An argparse type: a finite `kind` in (low, high] (or [low, high] with open_low=False)."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        inside = (low < v if open_low else low <= v) and v <= high
        if not inside:  # NaN is never inside
            bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {text!r}")
        return v

    return parse


def positive(kind, high=2**31):
    """> 0, finite and at most `high`."""
    return bounded(kind, 0, high)


def output_problem(flag: str, path: str) -> str | None:
    """Why `path` cannot be written as a file (checked before any work), or None."""
    try:
        check_path(flag, path)
    except ValueError as e:
        return str(e)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{flag} {path!r} is a directory, not a file to write"
    if not os.path.isdir(folder):
        return f"{flag} {path!r}: the folder {folder!r} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag} {path!r}: the folder {folder!r} is not writable"
    return None
