"""Routing traces: the expert load of every MoE layer over training, as JSON lines (opt-in).

    trace = moe.RoutingTrace(model, run_dir / "routing_trace.jsonl", every=10)
    for step in range(steps):
        ...                      # forward(s), backward, optimizer step
        trace.step()             # on every rank (a collective on the log interval only)
    trace.close()                # writes the steps still buffered (a collective too)

A step's counts are summed over every training-mode forward of the layer since the previous
`step()` (all micro-batches; a forward recomputed in backward is not counted), taken from
`layer.stats` by a forward hook as device tensors: no host sync. Every `every` steps the
buffered steps of all layers are all-reduced over `group` (default: all ranks) in one call and
read once; rank 0 appends one line per step and layer:

    {"step": 12, "layer": "blocks.0.ffn", "tokens_per_expert": [...], "routed_per_expert":
     [...], "dropped": 3, "load_cv": 0.41, "max_over_mean": 1.9, "dead_experts": 0,
     "ep": 2, "rank_load": [...]}

and, after each `record_rebalance(step, report)`, one rebalance record per layer
({"kind": "rebalance", ...}: copies per expert, load before and after, slots moved, bytes
sent; moe/trace/rebalance_records.py).

tokens_per_expert: pairs each expert computed (after capacity drops); routed_per_expert: pairs
the router sent it (before drops). The load metrics are those of routed_per_expert, as in
layer.stats: load_cv = std / mean (population std), max_over_mean, dead_experts = experts with
no pair; rank_load = routed pairs per EP rank: expert e counts for the rank holding its slot
(`layer.slot_of_expert_E[e] // (E/ep)`, contiguous blocks until moe.parallel.rebalance_experts
moves experts; ep = 1 without expert parallelism). `read_trace` reads a file back, checking each line.
"""

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe.comm.consistency import all_gather_records
from moe.gating.balance import in_recomputation
from moe.layer import moe_layers
from moe.trace.rebalance_records import KIND as REBALANCE
from moe.trace.rebalance_records import check_field_types, check_rebalance_line, rebalance_lines
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


class RoutingTrace:
    """Per step and MoE layer: tokens per expert, drops, load CV, max/mean, dead experts and
    per-EP-rank load, written to `path` (JSON lines) by rank 0 every `every` steps.

    `resume_from=step` (a run resumed from a checkpoint at `step`) keeps the file's lines up to
    that step, drops later ones and numbers new steps from step + 1; by default the file starts
    empty. A damaged file to resume (read_trace's checks) or a path that is not a regular file
    (a FIFO, a directory) is a ValueError naming it, on every rank, before anything is written.
    `training_only=False` counts eval-mode forwards too."""

    def __init__(
        self,
        model: nn.Module,
        path: str | Path,
        every: int = 1,
        *,
        group=None,
        resume_from: int | None = None,
        training_only: bool = True,
    ):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"RoutingTrace: every must be a positive int, got {every!r}")
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("RoutingTrace: the model has no MoE layers (moe.MoELayer)")
        self.path, self.every, self.group = Path(path), every, group
        self.training_only = training_only
        self.distributed = dist.is_available() and dist.is_initialized()
        self.writer = not self.distributed or dist.get_rank() == 0
        self.experts = [layer.config.num_experts for _, layer in self.layers]
        self.ep = [  # expert slots (experts + spare slots) over the slots this rank holds
            layer.num_slots // layer.experts.num_experts for _, layer in self.layers
        ]
        self.steps_done = resume_from or 0  # default line numbers continue after it
        self.buffer: list[torch.Tensor] = []  # one packed row per step, on the device
        self.pending: list[dict] = []  # rebalance records, written after the buffered steps
        self.step_ids: list[int] = []
        self.current: list[torch.Tensor | None] = [None] * len(self.layers)
        self.hooks = [
            layer.register_forward_hook(self._hook(i)) for i, (_, layer) in enumerate(self.layers)
        ]
        problem = self._start_file(resume_from) if self.writer else None
        if self.distributed:  # the writer's problem is every rank's error (no rank left waiting)
            problems = [r["problem"] for r in all_gather_records({"problem": problem}, group)]
            problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            self.close()
            raise ValueError(problem)

    def _start_file(self, resume_from: int | None) -> str | None:
        """Write a new file, or (resuming) the lines up to the checkpoint's step; a problem
        (a damaged file, a path that is not a regular file) is returned, nothing written."""
        try:
            if os.path.lexists(self.path) and not self.path.is_file():
                raise ValueError(f"routing trace {str(self.path)!r}: not a regular file")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_from is not None and self.path.exists():
                kept = [r for r in read_trace(self.path) if r["step"] <= resume_from]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        except (ValueError, OSError) as e:
            return str(e)
        return None

    def _hook(self, index: int):
        def add(layer, inputs, output) -> None:
            if (self.training_only and not layer.training) or in_recomputation():
                return
            s = layer.stats
            row = torch.cat([s["tokens_per_expert"], s["routed_per_expert"], s["dropped"][None]])
            total = self.current[index]
            self.current[index] = row.long() if total is None else total + row

        return add

    def step(self, step: int | None = None) -> None:
        """End of a training step: keep its counts (device only); every `every` steps reduce
        and write them. `step` numbers the line (default: steps since the trace began, from 1).
        """
        if step is not None:
            _check_step(step, "RoutingTrace.step")
        self.steps_done += 1
        self.step_ids.append(self.steps_done if step is None else step)
        rows = []
        for (_, layer), E, total in zip(self.layers, self.experts, self.current):
            if total is None:  # no forward this step: zeros (still joins the all-reduce)
                total = torch.zeros(2 * E + 1, dtype=torch.long, device=_device(layer))
            rows.append(total)
        self.buffer.append(torch.cat([r.to(rows[0].device) for r in rows]))
        self.current = [None] * len(self.layers)
        if len(self.buffer) >= self.every:
            self.flush()

    def record_rebalance(self, step: int, report) -> None:
        """A moe.parallel.rebalance_experts call's per-layer summary (its RebalanceReport:
        copies per expert, load before and after, slots moved, bytes sent; see
        moe/trace/rebalance_records.py), written with the next flush after the steps buffered now.
        Host data only: no collective, any rank may call it (the writer writes)."""
        _check_step(step, "RoutingTrace.record_rebalance")
        ep = dict(zip((name for name, _ in self.layers), self.ep))
        experts = dict(zip((name for name, _ in self.layers), self.experts))
        layers = getattr(report, "layers", None)
        if not isinstance(layers, dict):
            raise ValueError(
                "RoutingTrace.record_rebalance: expected the RebalanceReport that "
                f"moe.parallel.rebalance_experts returned, got {type(report).__name__}"
            )
        for name, placement in layers.items():
            E = len(getattr(placement, "slot_of_expert", ()))
            if experts.get(name) != E:
                raise ValueError(
                    f"RoutingTrace.record_rebalance: the report's layer {name!r:.100} "
                    f"({E} experts) is not a layer of the traced model "
                    f"({', '.join(f'{n}: {e}' for n, e in list(experts.items())[:4])})"
                )
        self.pending += rebalance_lines(step, report, ep)

    def flush(self) -> None:
        """Reduce and write the buffered steps now (a collective: every rank calls it)."""
        if not self.buffer:
            self._write_pending()
            return
        packed_SN = torch.stack(self.buffer)
        if self.distributed:
            dist.all_reduce(packed_SN, group=self.group)
        values = packed_SN.tolist()  # the one host read of the interval
        step_ids = self.step_ids
        self.buffer, self.step_ids = [], []
        if not self.writer:
            return
        # where each expert lives now (moe.parallel.rebalance_experts may have moved it)
        slots = [_rank_slots(layer, ep) for (_, layer), ep in zip(self.layers, self.ep)]
        with self.path.open("a") as f:
            for step, row in zip(step_ids, values):
                offset = 0
                for (name, _), E, ep, slot in zip(self.layers, self.experts, self.ep, slots):
                    kept, routed = row[offset : offset + E], row[offset + E : offset + 2 * E]
                    dropped = row[offset + 2 * E]
                    offset += 2 * E + 1
                    line = trace_line(step, name, kept, routed, dropped, ep, slot)
                    f.write(json.dumps(line) + "\n")
        self._write_pending()

    def _write_pending(self) -> None:
        lines, self.pending = self.pending, []
        if self.writer and lines:
            with self.path.open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)

    def close(self) -> None:
        """Write what is buffered and remove the hooks."""
        self.flush()
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def __enter__(self) -> "RoutingTrace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_step(step, what: str) -> None:
    """A step number read_trace accepts: an int >= 0 (no bool, no float)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{what}: step must be an int >= 0, got {step!r:.100}")


def _rank_slots(layer, ep: int) -> list[int]:
    """Each expert's row as trace_line reads it (rank = row // (E / ep)): the EP rank of its
    (first) slot, times E / ep."""
    layout = layer.slot_layout()
    return [r * (layout.num_experts // ep) for r in layout.rank_of_expert(ep)]


def _device(layer) -> torch.device:
    return layer.router.weight.device


def trace_line(
    step: int,
    layer: str,
    kept: list,
    routed: list,
    dropped: int,
    ep: int,
    slots: list | None = None,
) -> dict:
    """One JSON line: the counts and the load metrics of `routed` (see the module docstring).
    `slots[e]` is expert e's row in the experts' weights (default e): EP rank slots[e] // (E/ep)
    holds it."""
    E = len(routed)
    slots = slots if slots is not None else list(range(E))
    mean = sum(routed) / E
    std = math.sqrt(sum((c - mean) ** 2 for c in routed) / E)
    block = E // ep
    return {
        "step": step,
        "layer": layer,
        "tokens_per_expert": kept,
        "routed_per_expert": routed,
        "dropped": dropped,
        "load_cv": std / mean if mean > 0 else 0.0,
        "max_over_mean": max(routed) / mean if mean > 0 else 0.0,
        "dead_experts": sum(c == 0 for c in routed),
        "ep": ep,
        "rank_load": [
            sum(c for c, slot in zip(routed, slots) if slot // block == r) for r in range(ep)
        ],
    }


def read_trace(path: str | Path) -> list[dict]:
    """The lines of a trace file, each checked (fields, types, ranges, lengths; one layer keeps
    its E and ep); a bad line is a ValueError naming the file and line number. Time is linear
    in the file: JSON is parsed with bounded nesting and integers of at most 19 digits."""
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
            shape = (E, record["ep"])
            if shape_of.setdefault(record["layer"], shape) != shape:
                raise ValueError(
                    f"{where}: layer {record['layer']!r} has E={shape[0]}, ep={shape[1]} here and "
                    f"E={shape_of[record['layer']][0]}, ep={shape_of[record['layer']][1]} above"
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


__all__ = ["RoutingTrace", "read_trace"]
