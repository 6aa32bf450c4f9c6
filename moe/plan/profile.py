"""python -m moe.plan profile --out cluster.json: measure the machines it runs on (every rank
under torchrun, or one process) and write a cluster file the planner reads (--cluster).
Under torchrun it joins a process group itself (NCCL for GPU tensors, gloo for host ones)
unless its caller already has one.

Measured: matmul throughput at the expert GEMM's shape for growing row counts, fitted to
rate(rows) = R rows / (rows + h) (1 / rate is linear in 1 / rows); device memory bandwidth
(a large copy); the host link (a device-to-host copy on CUDA; on CPU the same copy); and
point-to-point time per size between two ranks of one node and of two nodes (torchrun's
LOCAL_WORLD_SIZE ranks per node), fitted to latency + bytes / bandwidth, and how many of a
node's ranks share its inter-node link (nic_ranks); a world reduce-scatter against an
all-gather of the same bytes (reduce_scatter_factor). What one process
cannot measure (links without a second rank or node, FP8 throughput) keeps the preset's
figure, and the file's `source` says which. Also the fixed framework costs of
moe/plan/overhead.py (per block, per MoE block, per micro-batch, per optimizer step, on tiny
generic modules) and, with more than one rank, the latency of one collective call (a 4-byte
all_reduce over the world), a ring step's latency and how much of a data-parallel
all-reduce runs under compute (measure_ring), at the model's widths and a micro-batch's
tokens (--d-model, --d-ff, --tokens); every rank measures at once (barriers) and each figure
is the slowest rank's (the fixed costs: the median rank's); --dtype picks the precision the
GEMMs and overheads run in.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import platform
import time
import warnings
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from moe.plan.checks import output_problem, positive
from moe.plan.cluster import PRESETS, Cluster
from moe.plan.overhead import D, T, measure_overheads
from moe.settings import local_world_size, torchrun_ranks

# a GEMM timing round's length: long against a scheduler's slice (a few ms)
GEMM_ROUND_SECONDS = 0.05


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _synced(fn, repeats: int, rounds: int = 5) -> float:
    """Seconds per call of fn, as every rank sees it while all run it at once (a barrier
    before each round of `repeats` calls): the median round of the slowest rank. The ranks of
    a training step share the machine and wait for each other the same way."""
    fn()
    out = []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        out.append(_timed(fn, repeats))
    t = torch.tensor([float(np.median(out))], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def fit_rate(rows: list[int], rates: list[float]) -> tuple[float, float]:
    """(R, h) of rate = R rows / (rows + h), least squares on 1 / rate = 1/R + h/R / rows."""
    A = np.stack([np.ones(len(rows)), 1 / np.asarray(rows, float)], 1)
    inv = 1 / np.asarray(rates, float)
    (a, b), *_ = np.linalg.lstsq(A, inv, rcond=None)
    a = max(a, float(inv.min()) / 2)  # a peak above twice the best measured rate is noise
    return 1 / a, max(b / a, 1e-3)


def fit_link(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(bandwidth, latency) of t = latency + bytes / bandwidth, least squares, clamped."""
    A = np.stack([np.ones(len(sizes)), np.asarray(sizes, float)], 1)
    (lat, inv_bw), *_ = np.linalg.lstsq(A, np.asarray(seconds, float), rcond=None)
    inv_bw = max(inv_bw, 1e-14)
    return 1 / inv_bw, min(max(lat, 0.0), 1.0)


def _repeats_for(fn, seconds: float) -> int:
    """Calls of fn that take about `seconds` (at least 1), the largest count any rank asks
    for (every rank calls; fn must not communicate)."""
    n = torch.tensor([max(1, math.ceil(seconds / max(_timed(fn, 3), 1e-9)))], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n)


def measure_gemm(d: int, f: int, device, dtype, rows=(16, 64, 256, 1024)) -> tuple[float, float]:
    """Each row count timed in rounds of about GEMM_ROUND_SECONDS: rounds of a few small
    matmuls (10 calls of 16 rows: 0.1 ms on a CPU) see a scheduler's slice, not a rate
    (0.08-0.21 TFLOP/s over nine profiles of one 2-core machine)."""
    x = {r: torch.randn(r, d, device=device, dtype=dtype) for r in rows}
    w = torch.randn(d, f, device=device, dtype=dtype)
    fns = {r: (lambda r=r: x[r] @ w) for r in rows}
    rates = [
        2 * r * d * f / _synced(fns[r], _repeats_for(fns[r], GEMM_ROUND_SECONDS)) for r in rows
    ]
    return fit_rate(list(rows), rates)


def measure_copy(nbytes: int, device) -> tuple[float, float]:
    """(device memory bytes/s, host link bytes/s)."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    mem = 2 * nbytes / _timed(lambda: dst.copy_(src), 10)
    if device.type != "cuda":
        return mem, mem
    host = torch.empty(src.shape, pin_memory=True)
    return mem, nbytes / _timed(lambda: host.copy_(src, non_blocking=False), 10)


def measure_p2p(peer_a: int, peer_b: int, device, sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22)):
    """Ping-pong between two ranks (every rank calls; the others wait at the barrier)."""
    rank, out = dist.get_rank(), []
    for n in sizes:
        buf = torch.empty(n // 4, device=device)
        dist.barrier()
        if rank in (peer_a, peer_b):
            other = peer_b if rank == peer_a else peer_a

            def ping(buf=buf, other=other):
                if rank == peer_a:
                    dist.send(buf, other)
                    dist.recv(buf, other)
                else:
                    dist.recv(buf, other)
                    dist.send(buf, other)

            out.append(_timed(ping, 10) / 2)
    dist.barrier()
    return fit_link(list(sizes), out) if out else None


def measure_ring(device, sizes=(1 << 10, 1 << 16, 1 << 18, 1 << 20)) -> tuple[float, float]:
    """(step latency, dp overlap) of the world's data-parallel collectives (every rank calls).
    Step latency: the intercept of a world all-reduce's time against its size over its
    2 (world - 1) ring steps. Overlap: an all-reduce of the largest size started
    asynchronously under matmuls of about its length, (t_comm + t_compute - t_both) /
    min(t_comm, t_compute) in [0, 1] (on 2 CPU cores shared by 4 ranks, gloo hides little)."""
    world = dist.get_world_size()
    bufs = [torch.randn(n // 4, device=device) for n in sizes]
    times = [_synced(lambda b=b: dist.all_reduce(b), 2) for b in bufs]
    _, lat = fit_link(list(sizes), times)
    a = torch.randn(128, 128, device=device)
    k = max(1, round(times[-1] / _synced(lambda: a @ a, 10)))

    def compute():
        for _ in range(k):
            a @ a

    def both():
        work = dist.all_reduce(bufs[-1], async_op=True)
        compute()
        work.wait()

    t_comp, t_both = _synced(compute, 1), _synced(both, 1)
    hidden = (times[-1] + t_comp - t_both) / min(times[-1], t_comp)
    return lat / (2 * (world - 1)), min(max(hidden, 0.0), 1.0)


def measure_link_sharing(local: int, device, nbytes: int = 1 << 20) -> int:
    """Ranks of a node that share its inter-node link (every rank calls; two nodes or more):
    node 0's ranks stream nbytes to node 1's (rank i to local + i) all at once against rank
    0 alone; the ratio of the times, rounded, in [1, local]."""
    rank, buf = dist.get_rank(), torch.empty(nbytes // 4, device=device)

    def stream(senders: int) -> None:
        if rank < senders:
            dist.send(buf, rank + local)
        elif local <= rank < local + senders:
            dist.recv(buf, rank - local)

    alone, together = _synced(lambda: stream(1), 3), _synced(lambda: stream(local), 3)
    return int(min(max(round(together / alone), 1), local))


def measure_reduce_scatter(device, nbytes: int = 1 << 18) -> float:
    """A world reduce-scatter's time over a world all-gather's of the same bytes (nbytes per
    rank's shard; every rank calls), at least 1: NCCL's rings move the same bytes either
    way, gloo all-reduces the whole input."""
    world = dist.get_world_size()
    shard = torch.randn(nbytes // 4, device=device)
    full = torch.randn(world * shard.numel(), device=device)
    # torch 2.13's names (the older ones warn there); torch 2.11 has only the older ones
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gather = _synced(lambda: all_gather(full, shard), 2)
    scatter = _synced(lambda: reduce_scatter(shard, full), 2)
    return max(scatter / gather, 1.0)


def measure_collective_latency(repeats: int = 20) -> float:
    """Median seconds of a 4-byte all_reduce over the world (every rank calls)."""
    buf = torch.zeros(1)
    out = []
    for i in range(repeats + 3):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 3:
            out.append(float(t))
    return float(np.median(out))


def measure_links(base: Cluster, device, world: int, local: int) -> tuple[dict, list[str]]:
    """(the Cluster fields of the links and collectives, what keeps the preset's figure):
    every rank calls; one process measures none of them."""
    kept = ["fp8 throughput (2x bf16)"]
    intra = inter = None
    if world > 1 and local > 1:
        intra = measure_p2p(0, 1, device)
    nic_ranks, rs_factor = base.nic_ranks, base.reduce_scatter_factor
    if world > local:
        inter = measure_p2p(0, local, device)
        nic_ranks = measure_link_sharing(local, device) if local > 1 else 1
    if world > 1:
        rs_factor = measure_reduce_scatter(device)
    coll = measure_collective_latency() if world > 1 else 0.0
    step_lat, overlap = measure_ring(device) if world > 1 else (0.0, base.dp_overlap)
    if intra is None:
        kept.append("intra-node link")
    if inter is None:
        kept.append("inter-node link and its sharing")
    if world == 1:
        kept.append("reduce-scatter factor")
    intra = intra or (base.intra_bw, base.intra_latency)
    inter = inter or (base.inter_bw, base.inter_latency)
    fields = dict(
        intra_bw=intra[0], intra_latency=intra[1], inter_bw=inter[0], inter_latency=inter[1],
        collective_latency=coll, step_latency=step_lat, dp_overlap=overlap,
        nic_ranks=nic_ranks, reduce_scatter_factor=rs_factor,
    )  # fmt: skip
    return fields, kept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moe.plan profile", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, help="the cluster file to write (JSON)")
    p.add_argument("--preset", default="h100", choices=sorted(PRESETS),
                   help="figures that cannot be measured here")  # fmt: skip
    p.add_argument("--device-mem", type=positive(float, 2**20),
                   help="GiB per device, in (0, 2**20] (default: CUDA's, else the preset's)")  # fmt: skip
    p.add_argument("--d-model", type=positive(int, 1 << 16), default=1024,
                   help="the expert GEMM's input width, in [1, 65536]")  # fmt: skip
    p.add_argument("--d-ff", type=positive(int, 1 << 16), default=1024,
                   help="the expert GEMM's output width, in [1, 65536]")  # fmt: skip
    p.add_argument("--tokens", type=positive(int, 1 << 16), default=128,
                   help="tokens of one micro-batch, in [1, 65536]")  # fmt: skip
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        help="the training precision (default: bfloat16 on CUDA, else float32)",
    )
    args = p.parse_args(argv)
    problem = output_problem("--out", args.out)
    if problem:  # before any measurement
        p.error(problem)
    cuda = torch.cuda.is_available()
    with _process_group(cuda):
        return _profile(args, cuda)


def _say(text: str) -> None:
    """A progress line (rank 0): the profile measures for a minute or two."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"moe.plan profile: {text}", flush=True)


@contextlib.contextmanager
def _process_group(cuda: bool):
    """Under torchrun (WORLD_SIZE > 1) without a process group yet: join one for the profile
    (NCCL for each rank's LOCAL_RANK GPU and gloo for the host tensors the figures are
    reduced in; gloo alone without CUDA) and leave it after; otherwise nothing (one process,
    or a caller that initialised its own, which must take CPU tensors too)."""
    world, local_rank = torchrun_ranks()
    if world == 1 or dist.is_initialized():
        yield
        return
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _profile(args: argparse.Namespace, cuda: bool) -> int:
    """Every measurement, then the cluster file (rank 0 writes it)."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = (
        getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    _say(f"1/4 the expert GEMM's rate ({args.d_model} x {args.d_ff}, {dtype}) on {world} rank(s)")
    R, h = measure_gemm(args.d_model, args.d_ff, device, dtype)
    rate = lambda rows: R * rows / (rows + h)  # noqa: E731 - the cluster's gemm_rate
    size = (args.d_model, args.d_ff, args.tokens)
    _say("2/4 the fixed framework costs (moe/plan/overhead.py)" + (": not on CUDA" if cuda else ""))
    with warnings.catch_warnings():  # the reference modules' random init on a CPU mesh
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
        overheads = measure_overheads(dtype, size=size, rate=rate) if not cuda else {}
    extra = overheads.pop("ep_block_extra", None)  # ep_overhead, once the links are known
    _say("3/4 memory and host bandwidth")
    mem_bw, host_bw = measure_copy(1 << 26, device)
    base = PRESETS[args.preset]
    local = int(local_world_size() or world)
    _say("4/4 the links between ranks" + ("" if world > 1 else ": one process, none"))
    links, kept = measure_links(base, device, world, local)
    mem = args.device_mem or (
        torch.cuda.get_device_properties(device).total_memory / 2**30
        if cuda
        else base.device_memory_gib
    )
    cluster = replace(
        base,
        nodes=max(world // local, 1),
        gpus_per_node=local if world > 1 else base.gpus_per_node,
        device_memory_gib=mem,
        tflops_bf16=R / 1e12,
        tflops_fp8=2 * R / 1e12,
        hbm_bw=mem_bw,
        host_bw=host_bw,
        gemm_efficiency=1.0,
        gemm_half_rows=h,
        **overheads,
        **links,
        fsdp_gathered_units=2 if cuda else 1,  # ops run synchronously on a CPU
        name="profile",
        source=f"measured by python -m moe.plan profile on {platform.node()} "
        f"{datetime.date.today()} ({device.type}, {dtype}); from the {args.preset} preset: "
        + ", ".join(kept),
    )
    if extra is not None:  # beyond the block's 4 exchanges as predict counts them
        one = cluster.cost_model().flat_time(T * 2 * D * 2, cluster.nodes, cluster.gpus_per_node)
        cluster = replace(cluster, ep_overhead=max(extra - 4 * one, 0.0))  # T x top 2 x D, bf16
    if not dist.is_initialized() or dist.get_rank() == 0:
        Cluster.__post_init__(cluster)
        cluster.save(args.out)
        print(f"moe.plan profile: wrote {args.out}: {cluster.source}")
    return 0
