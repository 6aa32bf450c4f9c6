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
read once; the group's rank 0 appends one line per step and layer:

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
from moe.trace.rebalance_records import rebalance_lines
from moe.trace.segments import prepare_resume
from moe.trace.trace_file import read_trace

__all__ = ["RoutingTrace", "read_trace", "trace_line"]


class RoutingTrace:
    """Per step and MoE layer: tokens per expert, drops, load CV, max/mean, dead experts and
    per-EP-rank load, written to `path` (JSON lines) by rank 0 every `every` steps.

    `resume_from=step` (a run resumed from a checkpoint at `step`) keeps the file's lines up to
    that step, drops later ones and numbers new steps from step + 1; resumed at another EP
    size, the earlier layouts' lines go to files of their own beside it (moe/trace/segments.py,
    `segments(path)` lists them), so every file holds one layout. By default the file starts
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
        # the group's first rank writes (a pipeline stage's trace: its first rank)
        self.writer = not self.distributed or dist.get_rank(group) == 0
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
            if resume_from is not None:  # earlier layouts' lines into their own files
                prepare_resume(self.path, resume_from, self.ep[0])
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
