"""One rank of the pipeline benchmark: every (schedule, micro-batch count) of one (pp, dp, ep)
layout through moe.pipeline.Pipeline, timing each step and the time this rank spends inside
its stages' computations.

Busy time: PipelineStage.forward_one_chunk, backward_one_chunk (full or input backward) and
backward_weight_one_chunk are wrapped (in this process only) by a clock that sums the wall
time spent inside them, and the loss function (run by the schedule on the last stage) is
timed too. The schedules wait for a stage's P2P receives before calling these methods, so
what the clock leaves out is waiting and the schedule's own bookkeeping; what it includes is
the stage's forward / backward, with the MoE layer's expert-parallel exchange (ep > 1) and
the last backward's gradient reduction over the stage's ranks. Step time: every rank starts
a step after a barrier; the pipeline's step time is the slowest rank's wall time. Bubble of a
rank = 1 - busy / step time, per step, median over steps. All cases of a layout are built
first and timed in interleaved rounds (one step of each per round), so drifting machine load
touches every schedule alike.

Peak memory: one extra step under bench.memory.AllocationCounter (a TorchDispatchMode adding
the bytes of every storage an op creates and subtracting them when freed: CPU has no allocator
statistics), after the timed steps, gradients freed before it so they count: the bytes the
step added at its peak (activations kept for the backward, gradients, temporaries), next to
the rank's parameter bytes.
"""

from __future__ import annotations

import datetime
import functools
import json
import statistics
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

import moe
from bench.memory import AllocationCounter
from moe.parallel import ParallelConfig
from moe.pipeline import Pipeline, PipelineConfig, init_pipeline_mesh

_STAGE_METHODS = {
    "forward": "forward_one_chunk",
    "backward": "backward_one_chunk",
    "weight": "backward_weight_one_chunk",
}


class BusyClock:
    """Wall seconds spent inside the wrapped calls since reset(), by kind, and the CPU
    seconds of this thread in them (`cpu`: less than the wall time when the rank was
    descheduled, as 4 ranks on 2 cores are); a call inside another is not counted twice."""

    def __init__(self):
        self.seconds = dict.fromkeys([*_STAGE_METHODS, "loss"], 0.0)
        self.cpu = 0.0
        self._depth = 0
        self._installed = False

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.cpu = 0.0

    def wrap(self, kind: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start
                self.cpu += time.thread_time() - cpu
                self._depth -= 1

        return timed

    def install(self) -> None:
        """Wrap PipelineStage's compute methods (once per process)."""
        if self._installed:
            return
        for kind, name in _STAGE_METHODS.items():
            setattr(PipelineStage, name, self.wrap(kind, getattr(PipelineStage, name)))
        self._installed = True


class Block(nn.Module):
    """Pre-norm residual MoE feed-forward block."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.norm = nn.LayerNorm(cfg["d_model"])
        self.ffn = moe.MoELayer(
            cfg["d_model"], cfg["d_ff"], cfg["experts"], top_k=cfg["top_k"], aux_loss_coef=0.01
        )

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class Head(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.norm = nn.LayerNorm(cfg["d_model"])
        self.out = nn.Linear(cfg["d_model"], cfg["vocab"])

    def forward(self, x):
        return self.out(self.norm(x))


def build_model(cfg: dict) -> nn.Sequential:
    """embed, b0 .. b{blocks-1} (all MoE), head; the same weights on every rank."""
    torch.manual_seed(0)
    blocks = [(f"b{i}", Block(cfg)) for i in range(cfg["blocks"])]
    embed = nn.Embedding(cfg["vocab"], cfg["d_model"])
    return nn.Sequential(OrderedDict([("embed", embed), *blocks, ("head", Head(cfg))]))


def stage_plan(blocks: int, num_stages: int) -> list[list[str]]:
    """Equal block counts per stage; the embedding joins the first, the head the last."""
    if blocks % num_stages:
        raise ValueError(f"{blocks} blocks do not split evenly into {num_stages} stages")
    k = blocks // num_stages
    plan = [[f"b{s * k + i}" for i in range(k)] for s in range(num_stages)]
    plan[0].insert(0, "embed")
    plan[-1].append("head")
    return plan


def stages_per_rank(schedule: str) -> int:
    """1 for GPipe / 1F1B, 2 for the interleaved and V schedules."""
    try:
        style = PipelineConfig(schedule).style
    except ValueError:  # a V schedule refuses one stage per rank
        style = "v"
    return 1 if style == "single" else 2


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _zero_grads(pipe: Pipeline) -> None:
    for p in pipe.parameters():
        p.grad = None


class Case:
    """One schedule at m micro-batches on this rank: its Pipeline, its batch, its samples."""

    def __init__(self, mesh, cfg: dict, schedule: str, m: int, clock: BusyClock):
        pp, width = mesh.size(0), mesh.size(1) * mesh.size(2)
        self.schedule, self.m, self.v = schedule, m, stages_per_rank(schedule)
        self.mesh, self.cfg = mesh, cfg
        config = PipelineConfig(
            schedule,
            microbatches=m,
            stages_per_rank=self.v,
            stages=stage_plan(cfg["blocks"], pp * self.v),
        )

        def loss_fn(logits, target):
            return F.cross_entropy(logits.flatten(0, -2), target.flatten()) / m

        parallel = ParallelConfig("ddp", "flat")
        self.pipe = Pipeline(build_model(cfg), mesh, config, clock.wrap("loss", loss_fn), parallel)
        g = torch.Generator().manual_seed(1 + dist.get_rank() % width)  # a batch per pipeline
        rows = m * cfg["microbatch_rows"]
        self.x = torch.randint(cfg["vocab"], (rows, cfg["seq"]), generator=g)
        self.y = torch.randint(cfg["vocab"], (rows, cfg["seq"]), generator=g)
        self.walls: list[float] = []
        self.busy: list[float] = []
        self.busy_cpu: list[float] = []
        self.parts: list[dict] = []
        self.peak = 0

    def step(self) -> None:
        self.pipe.step(self.x, self.y)
        _zero_grads(self.pipe)

    def timed_step(self, clock: BusyClock) -> None:
        dist.barrier()
        clock.reset()
        start = time.perf_counter()
        self.pipe.step(self.x, self.y)
        self.walls.append(time.perf_counter() - start)
        self.busy.append(sum(clock.seconds.values()))
        self.busy_cpu.append(clock.cpu)
        self.parts.append(dict(clock.seconds))
        _zero_grads(self.pipe)

    def memory_step(self) -> None:
        """One step under the allocation counter, gradients freed before (they count)."""
        counter = AllocationCounter()
        dist.barrier()
        with counter:  # the schedule runs on this thread: the counter sees the stages' work
            self.pipe.step(self.x, self.y)
        _zero_grads(self.pipe)
        self.peak = counter.peak

    def record(self) -> dict:
        steps = _slowest(self.walls)  # the pipeline's step: its slowest rank
        bubbles = [max(0.0, 1.0 - b / s) for b, s in zip(self.busy, steps)]
        pipe = self.pipe
        return {
            "schedule": self.schedule,
            "microbatches": self.m,
            "stages_per_rank": self.v,
            "rank": dist.get_rank(),
            "pp_rank": self.mesh.get_local_rank("pp"),
            "stage_indices": pipe.stage_indices,
            "stages": [list(module._modules) for module in pipe.modules],
            "wall_s": self.walls,
            "step_s": steps,
            "busy_s": self.busy,
            "busy_cpu_s": self.busy_cpu,
            "busy_parts_s": {k: statistics.median(p[k] for p in self.parts) for k in self.parts[0]},
            "bubble": statistics.median(bubbles),
            "bubbles": bubbles,
            "step_peak_bytes": self.peak,
            "param_bytes": sum(_local(p).nbytes for p in pipe.parameters()),
            "tokens_per_microbatch": self.cfg["microbatch_rows"] * self.cfg["seq"],
        }


def worker_main(cfg: dict) -> None:
    """Every case of the layout built first, warmed up, then timed in interleaved rounds (one
    step of each case per round, the starting case rotating), so drifting machine load
    touches every schedule alike; then one memory step each."""
    torch.set_num_threads(1)
    # FSDP2's note on the stage outputs (views of the aux-loss alias; nothing here changes
    # them in place), once per module and rank otherwise
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout"]))
    pp, dp, ep = cfg["layout"]
    mesh = init_pipeline_mesh(pp, dp, ep)
    clock = BusyClock()
    clock.install()
    cases, skipped = [], []
    for schedule in cfg["schedules"]:
        for m in cfg["microbatches"]:
            try:
                v = stages_per_rank(schedule)
                PipelineConfig(schedule, microbatches=m, stages_per_rank=v).check_stages(pp)
                stage_plan(cfg["blocks"], pp * v)
            except ValueError as e:  # decided from the settings alone: alike on every rank
                skipped.append({"schedule": schedule, "microbatches": m, "reason": str(e)})
                continue
            cases.append(Case(mesh, cfg, schedule, m, clock))
    for case in cases:
        for _ in range(cfg["warmup"]):
            case.step()
    for r in range(cfg["steps"]):
        for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
            case.timed_step(clock)
        if dist.get_rank() == 0:
            print(f"  pp={pp} ep={ep}: round {r + 1}/{cfg['steps']}", flush=True)
    for case in cases:
        case.memory_step()
    mine = [case.record() for case in cases]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        ranks = [row for rows in every for row in rows]
        out = {"meta": cfg, "rows": ranks, "skipped": skipped}
        Path(cfg["json"]).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()
