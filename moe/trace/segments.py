"""A routing trace across expert-parallel layouts (issue 49 item 7).

A run saved at one (dp, ep) layout resumes at another (moe.checkpoint reshards), but one trace
file holds one layout (each layer keeps its E and ep; read_trace refuses a change). So a
trace resumed at another ep is kept as segments, one per layout, in step order:

    <dir>/routing_trace.steps-1-120.jsonl     earlier layouts' lines (steps 1..120)
    <dir>/routing_trace.jsonl                 the current layout's lines (the trace's path)

`prepare_resume` (RoutingTrace(resume_from=) runs it on the writing rank before it opens the
file) keeps every line up to the resume step, splits them where the layout changes, and leaves
in the trace's file only the segment of the resumed run's own layout (empty when the layout
changed): both directions, any number of changes, and a fall-back to an older step drops the
later lines. `segments(path)` lists the files in step order (examples/m6/plots.py draws them).
A layout is the EP size, which every MoE layer of a model shares.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

from moe.trace.trace_file import read_trace


def _layout(record: dict):
    """The EP size a line was recorded at (every line holds it)."""
    return record.get("ep")


def _segment_name(path: Path, first: int, last: int) -> str:
    return f"{path.stem}.steps-{first}-{last}{path.suffix}"


def _earlier(path: Path) -> list[tuple[int, Path]]:
    pattern = re.compile(re.escape(path.stem) + r"\.steps-(\d+)-(\d+)" + re.escape(path.suffix))
    found = []
    for p in path.parent.glob(f"{glob.escape(path.stem)}.steps-*{glob.escape(path.suffix)}"):
        m = pattern.fullmatch(p.name)
        if m and p.is_file() and not p.is_symlink():
            found.append((int(m.group(1)), p))
    return sorted(found)


def segments(path: str | Path) -> list[Path]:
    """A trace's files in step order: earlier layouts' segments first, then `path` itself."""
    path = Path(path)
    files = [p for _, p in _earlier(path)]
    return files + ([path] if path.is_file() else [])


def _lines(path: Path) -> list[dict]:
    """The lines of a trace file, each checked by read_trace (a damaged line is its ValueError
    naming file:line); a file from before this split may change its layout part-way."""
    return read_trace(path, one_layout=False)


def _write(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def prepare_resume(path: str | Path, start: int, layout: int) -> None:
    """Before a trace resumed at `start` with `layout` (its EP size) opens `path`: lines past
    `start` dropped, earlier layouts' lines into <stem>.steps-A-B<suffix> beside it, `path` left
    with the lines of the last segment if it has `layout`, else empty. A damaged file is a
    ValueError naming it (file:line)."""
    path = Path(path)
    files = segments(path)
    if not files:
        return
    kept = [r for f in files for r in _lines(f) if r["step"] <= start]
    runs: list[list[dict]] = []
    for r in kept:
        if not runs or _layout(r) != _layout(runs[-1][0]):
            runs.append([])
        runs[-1].append(r)
    current = runs.pop() if runs and _layout(runs[-1][0]) == layout else []
    names = set()
    for seg in runs:
        steps = [r["step"] for r in seg]
        seg_path = path.with_name(_segment_name(path, min(steps), max(steps)))
        _write(seg_path, seg)
        names.add(seg_path.name)
    _write(path, current)
    for _, p in _earlier(path):
        if p.name not in names:  # lines past `start`, or re-split: not part of the run now
            p.unlink()
