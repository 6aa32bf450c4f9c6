"""The routing trace of an M6 run across layouts (issue 49 item 7).

A run saved at one (dp, ep) layout resumes at another (moe.checkpoint reshards), but one
moe.RoutingTrace file holds one layout (each layer keeps its E and ep; read_trace refuses a
change). So the run's trace is kept as segments, one per layout, in file order:

    <run-dir>/routing_trace.steps-1-120.jsonl     earlier layouts' lines (steps 1..120)
    <run-dir>/routing_trace.jsonl                 the current layout's lines (RoutingTrace)

`prepare_resume` (rank 0, before RoutingTrace opens the file) keeps every line up to the
resume step, splits them where the layout changes, and leaves in routing_trace.jsonl only the
segment of the resumed run's own layout (empty when the layout changed): both directions, any
number of changes, and a fall-back to an older step drops the later lines as before.
`segments` lists the files in step order for the plot (examples/m6/plots.py).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from moe.trace.routing_trace import read_trace

CURRENT = "routing_trace.jsonl"
_SEGMENT = re.compile(r"routing_trace\.steps-(\d+)-(\d+)\.jsonl")


def _layout(record: dict) -> tuple:
    """(E, ep) of a line: the canonical experts and the EP size it was recorded at."""
    experts = record.get("routed_per_expert", record.get("copies_per_expert", ()))
    return len(experts) if isinstance(experts, list) else -1, record.get("ep")


def _earlier(out: Path) -> list[tuple[int, Path]]:
    found = []
    for p in out.glob("routing_trace.steps-*.jsonl"):
        m = _SEGMENT.fullmatch(p.name)
        if m and p.is_file() and not p.is_symlink():
            found.append((int(m.group(1)), p))
    return sorted(found)


def segments(out: Path) -> list[Path]:
    """The run's trace files in step order: earlier layouts first, then routing_trace.jsonl."""
    files = [p for _, p in _earlier(out)]
    current = out / CURRENT
    return files + ([current] if current.is_file() else [])


def _lines(path: Path) -> list[dict]:
    """The lines of a trace file, checked by moe.trace's read_trace (a damaged line is its
    ValueError naming file:line); a file from before this split, whose layout changes part-way
    (read_trace refuses that), is read line by line for its steps and layouts."""
    try:
        return read_trace(path)
    except ValueError as e:
        if " here and " not in str(e):  # not the layout change: damaged
            raise
    records = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        if raw.strip():
            try:
                r = json.loads(raw)
            except ValueError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e})") from None
            if not isinstance(r, dict) or type(r.get("step")) is not int:
                raise ValueError(f"{path}:{number}: not a routing-trace line")
            records.append(r)
    return records


def _write(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def prepare_resume(out: Path, start: int, layout: tuple) -> None:
    """Before a run resumed at `start` with `layout` ((E, ep) of its MoE layers) opens the
    trace: lines past `start` dropped, earlier layouts' lines into routing_trace.steps-A-B.jsonl,
    routing_trace.jsonl left with the lines of the last segment if it has `layout`, else empty.
    A damaged file is a ValueError naming it (file:line)."""
    files = segments(out)
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
        path = out / f"routing_trace.steps-{min(steps)}-{max(steps)}.jsonl"
        _write(path, seg)
        names.add(path.name)
    _write(out / CURRENT, current)
    for _, p in _earlier(out):
        if p.name not in names:  # lines past `start`, or re-split: not part of the run now
            p.unlink()
