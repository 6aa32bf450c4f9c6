"""One rank of bench/plan_measured.py: inside an initialised gloo process group, apply each
layout (moe.plan.Layout) to its model the way Layout.code() prints it, time `steps` training
steps after `warmup` (the slowest rank's time per step, median) and measure the peak of one
more step the way bench/memory.py does on CPU: its AllocationCounter (a TorchDispatchMode
adding every new tensor storage an op returns and subtracting it when freed) is active while
the model is built, parallelized and its optimizer state created, then again over one whole
step; peak = the most tracked bytes live during that step (weights, gradients, optimizer
state, activations, communication buffers made by torch ops), the fullest rank's, less the
optimizer bytes offload keeps on the host (bench/memory.py's host/device classification).
LocalCounter corrects the counter for DTensors and FSDP2's in-place storage resizes."""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

import moe
from bench.memory import AllocationCounter
from bench.plan_measured_lib.models import Batch, Sizes, build, loss_fn
from moe.fp8 import FP8Config
from moe.memory import GroupedApply, recompute_blocks
from moe.memory.recompute import find_repeated_blocks
from moe.parallel import init_mesh, parallelize
from moe.plan.layout import Layout


class LocalCounter(AllocationCounter):
    """bench.memory's AllocationCounter with two corrections for FSDP2 / EP models: an op's
    DTensor output counts its local shard (the wrapper's storage reports the global size),
    and a tracked storage resized in place (FSDP2 frees and re-allocates its unsharded
    parameters with UntypedStorage.resize_, not through an op) counts its new size."""

    def __init__(self):
        super().__init__()
        self._sizes: dict[int, int] = {}

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        counter, original = self, self._resize

        def resize_(storage, size):
            old = storage.nbytes()
            out = original(storage, size)
            key = id(storage)
            if key in counter._sizes:
                counter._sizes[key] = storage.nbytes()
                counter.live += storage.nbytes() - old
                counter.peak = max(counter.peak, counter.live)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def local(t):
            return t._local_tensor if isinstance(t, DTensor) else t

        inputs = {
            id(local(t).untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_meta
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(local(t).untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs: set[int]) -> None:
        key = id(storage)
        if key in inputs or key in self._tracked:
            return
        self._tracked.add(key)
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, 0)

    def _free(self, key: int, n: int) -> None:
        self._tracked.discard(key)
        self.live -= self._sizes.pop(key, 0)


def host_bytes(opt: GroupedApply, offload: str | None) -> int:
    """Optimizer bytes GroupedApply keeps on the host (offload), classified as bench/memory's
    Run.resident does: state tensors, host weight copies and the staging buffers (the fp32
    masters too with offload="all", which moves them; "optimizer" keeps them on the device,
    as GroupedApply documents, where bench/memory counts every CPU tensor); on a CPU
    they are in the counter's bytes but are not device memory. Each storage once, local
    shards of DTensors."""
    if not offload:
        return 0
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            t = t._local_tensor if isinstance(t, DTensor) else t
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for e in opt._entries:
        for key, t in opt.state_of(e.param).items():
            # offload="optimizer" keeps the fp32 masters on the device (GroupedApply's doc)
            if key != "master" or (t is not e.param and offload == "all"):
                add(t)
        if e.shadow is not e.param:
            add(e.shadow)
    staging = opt._pipeline.staging_bytes if getattr(opt, "_pipeline", None) else 0
    return sum(n for ptr, n in seen.items() if ptr) + staging


def _moe_options(model, layout: Layout) -> None:
    """MoEConfig fields of the layout (MoE recompute, FP8 dispatch) on every MoE layer."""
    for _, layer in moe.moe_layers(model):
        changes = {}
        if layout.recompute == "moe":
            changes["recompute"] = True
        if layout.fp8_dispatch:
            changes["fp8"] = FP8Config(dispatch=True)
        if changes:
            layer.config = replace(layer.config, **changes)


def _recompute(model, layout: Layout) -> None:
    if layout.recompute == "full":
        recompute_blocks(model)
    elif layout.recompute.startswith("blocks:"):
        n = int(layout.recompute.split(":")[1])
        recompute_blocks(model, find_repeated_blocks(model)[:n])


def prepare(model_name: str, sizes: Sizes, layout: Layout):
    """(forward + backward function, optimizer) of `layout` on this rank; all of it built
    here."""
    rank = dist.get_rank()
    model = build(model_name, sizes)
    _moe_options(model, layout)
    _recompute(model, layout)
    rows = layout.microbatches * layout.micro_batch_seqs
    batch = Batch(model_name, sizes, rows, rank)
    if layout.pp == 1:
        if layout.microbatches != 1:
            raise ValueError("pp = 1 layouts run one micro-batch per step here")
        mesh = init_mesh(dp=layout.dp, ep=layout.ep)
        parallelize(model, mesh, config=layout.parallel)
        params = model.named_parameters()

        def forward_backward():
            loss = loss_fn(batch.logits(model), batch.target)
            (loss + moe.aux_loss(model)).backward()

    else:
        from moe.pipeline import Pipeline, hf_stack, init_pipeline_mesh

        if model_name != "mixtral":
            raise ValueError("pp > 1 layouts run the Mixtral-like model (moe.pipeline.hf_stack)")
        mesh = init_pipeline_mesh(layout.pp, layout.dp, layout.ep)
        tokens = layout.micro_batch_seqs * sizes.seq_len

        def pipe_loss(logits, target):
            return loss_fn(logits, target) * target.numel() / tokens / layout.microbatches

        pipe = Pipeline(hf_stack(model), mesh, layout.pipeline, pipe_loss, layout.parallel)
        params = pipe.named_parameters()

        def forward_backward():
            pipe.step(batch.text, batch.target)

    opt = GroupedApply(
        list(params), torch.optim.AdamW, layout.groups, layout.offload, lr=1e-4, weight_decay=0.1
    )
    return forward_backward, opt


def _max(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_layout(model_name: str, sizes: Sizes, layout: Layout, steps: int, warmup: int) -> dict:
    """Median step time (s, slowest rank) and peak tracked bytes (fullest rank) of `layout`,
    and of each phase: forward + backward, then the optimizer step."""
    counter = LocalCounter()
    with counter:  # the model, its shards and the optimizer state are tracked
        forward_backward, opt = prepare(model_name, sizes, layout)

        def step():
            opt.zero_grad(set_to_none=True)
            forward_backward()
            opt.step()

        step()  # the first step creates the optimizer state
    for _ in range(max(warmup - 1, 0)):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(_max(time.perf_counter() - start)[0])
    opt.zero_grad(set_to_none=True)
    with counter:
        counter.peak = counter.live
        resident = counter.live
        forward_backward()
        backward_peak, counter.peak = counter.peak, counter.live
        opt.step()
    host = host_bytes(opt, layout.offload)
    peak, resident, host, backward_peak, step_peak = _max(
        max(backward_peak, counter.peak) - host, resident - host, host, backward_peak - host,
        counter.peak - host,
    )  # fmt: skip
    return {
        "step_time": statistics.median(times),
        "step_times": times,
        "peak_memory": peak,
        "resident_memory": resident,
        "host_memory": host,
        "backward_peak": backward_peak,
        "optimizer_peak": step_peak,
    }


def _groups() -> set:
    from torch.distributed.distributed_c10d import _world

    return set(_world.pg_map)


def _without_new_groups(run, *args):
    """run(*args), then the process groups it created (its meshes' and pipeline's) destroyed
    on every rank: gloo groups that outlive their layout keep threads and sockets."""
    before = _groups()
    try:
        return run(*args)
    finally:
        gc.collect()
        dist.barrier()
        for group in _groups() - before:
            dist.destroy_process_group(group)


def merge_passes(passes: list[list[dict]]) -> list[dict]:
    """Rows of the same layouts (in the same order) from several passes as one: pass_times
    each pass's median, step_times every step, step_time the fastest pass's median (noise
    only adds time); the memory figures (the same every pass) from the first."""
    out = [{**row, "step_times": [], "pass_times": []} for row in passes[0]]
    for rows in passes:
        for merged, row in zip(out, rows):
            merged["pass_times"].append(row["step_time"])
            merged["step_times"] += row["step_times"]
    for merged in out:
        merged["step_time"] = min(merged["pass_times"])
    return out


def measure_layouts(
    cases: list[tuple[str, Layout]], sizes: Sizes, steps: int, warmup: int, passes: int = 2
):
    """run_layout of every (model name, Layout), in order, on every rank, `passes` times over
    the whole list (merge_passes). bench/plan_measured.py runs each pass in new processes
    instead: in one process each layout ran slower than the one before it (up to 2x by the
    third pass on the 2-core machine)."""
    torch.set_num_threads(1)
    runs = []
    for _ in range(passes):
        rows = []
        for model_name, layout in cases:
            row = _without_new_groups(run_layout, model_name, sizes, layout, steps, warmup)
            rows.append({"model": model_name, "layout": layout.record(), **row})
        runs.append(rows)
    out = merge_passes(runs)
    if dist.get_rank() == 0:
        for row in out:
            print(
                f"  {row['model']:8s} {Layout(**row['layout']).short():60s} "
                f"{row['step_time'] * 1e3:8.1f} ms {row['peak_memory'] / 2**20:7.2f} MiB",
                flush=True,
            )
    return out
