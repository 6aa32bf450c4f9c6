"""Reading a routing-trace file back (moe.RoutingTrace writes it): each line checked as
untrusted input (fields, types, ranges, lengths, bounded JSON), one layer's E and ep kept per
file (a trace resumed at another EP size is split into per-layout files: segments.py)."""

import json
import math
from pathlib import Path

from moe.trace.rebalance_records import KIND as REBALANCE
from moe.trace.rebalance_records import check_field_types, check_rebalance_line
from moe.untrusted import MAX_DEPTH, json_depth, open_regular

MAX_LINE_BYTES = 1 << 24  # a trace line: one step of one layer (E counts)
MAX_LAYER_NAME = 1024  # characters of a layer's qualified name

FIELDS = {
    "step": int,
    "layer": str,
    "tokens_per_expert": list,
    "routed_per_expert": list,
    "dropped": int,
    "load_cv": float,
    "max_over_mean": float,
    "dead_experts": int,
    "ep": int,
    "rank_load": list,
}


def read_trace(path: str | Path, *, one_layout: bool = True) -> list[dict]:
    """The lines of a trace file, each checked (fields, types, ranges, lengths; one layer keeps
    its E, and its ep unless `one_layout` is False: a file written before traces were kept one
    layout per file, segments.py); a bad line is a ValueError naming the file and line number.
    Time is linear in the file: JSON is parsed with bounded nesting and integers of at most 19
    digits."""
    path = Path(path)
    records, shape_of = [], {}
    with open_regular(path, error=ValueError, what="routing trace") as f:  # no FIFO, device
        lines = iter(lambda: f.readline(MAX_LINE_BYTES + 1), b"")
        for number, raw in enumerate(lines, 1):
            where = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            record = _check_line(raw, where)
            E = len(record.get("routed_per_expert", record.get("copies_per_expert", ())))
            shape = (E, record["ep"] if one_layout else None)
            if shape_of.setdefault(record["layer"], shape) != shape:
                here, above = ((f"E={E}, ep={ep}" if ep else f"E={E}") for E, ep in
                               (shape, shape_of[record["layer"]]))  # fmt: skip
                raise ValueError(
                    f"{where}: layer {record['layer']!r} has {here} here and {above} above"
                )
            records.append(record)
    return records


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19:  # past int64: refused before int() works on it
        raise ValueError(f"integer of {len(text)} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not finite")
    return value


def _no_constant(text: str):
    raise ValueError(f"{text} is not a number")


def _check_line(raw: bytes, where: str) -> dict:
    """One trace line parsed (bounded nesting; NaN, Infinity, huge integers and duplicate keys
    refused) and checked field by field."""
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: JSON nested {depth} levels deep (at most {MAX_DEPTH})")
    record = parse_json(raw, where)
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "kind" in record:  # routing lines have none; moe/trace/rebalance_records.py's records
        if record["kind"] != REBALANCE:
            raise ValueError(f"{where}: unknown record kind {record['kind']!r:.100}")
        return check_rebalance_line(record, where, MAX_LAYER_NAME)
    check_field_types(record, FIELDS, where)
    if len(record["layer"]) > MAX_LAYER_NAME:
        raise ValueError(f"{where}: layer name longer than {MAX_LAYER_NAME} characters")
    for field in ("tokens_per_expert", "routed_per_expert", "rank_load"):
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in record[field]):
            raise ValueError(f"{where}: field {field!r} must hold integers")
    for field in ("step", "tokens_per_expert", "routed_per_expert", "dropped", "load_cv",
                  "max_over_mean", "dead_experts", "rank_load"):  # fmt: skip
        value = record[field]
        if (min(value, default=0) if isinstance(value, list) else value) < 0:
            raise ValueError(f"{where}: field {field!r} must not be negative")
    E, ep = len(record["routed_per_expert"]), record["ep"]
    if len(record["tokens_per_expert"]) != E or E == 0:
        raise ValueError(f"{where}: tokens_per_expert and routed_per_expert differ in length")
    if ep < 1 or E % ep or len(record["rank_load"]) != ep:
        raise ValueError(f"{where}: rank_load must hold ep={ep} values (ep divides E={E})")
    if record["dead_experts"] > E:
        raise ValueError(f"{where}: dead_experts {record['dead_experts']} > E={E}")
    return record


def parse_json(raw: bytes, where: str):
    """A JSON line: NaN, Infinity, integers past 19 digits and duplicate keys are errors."""
    try:
        return json.loads(
            raw,
            object_pairs_hook=_unique,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
        )
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    except ValueError as e:  # not UTF-8, a refused number or key
        raise ValueError(f"{where}: not JSON ({e})") from None


def _unique(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {key!r:.100} appears twice")
    return obj
