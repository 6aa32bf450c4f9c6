"""One rank of the overlap benchmark: one MoE layer's forward + backward with the plain and the
overlapped dispatcher, next to the exchange alone and the experts alone, all on the same rows.

Every variant runs in interleaved rounds (one fwd + bwd each, after a barrier); a variant's
time is the median over rounds of the slowest rank's time. "auto" gets a cost model fitted on
this network from two exchanges timed here (t = a + b * S), identical on every rank.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import moe
from moe.comm import set_cost_model
from moe.comm.alltoall import exchange
from moe.comm.cost_model import MAX_BANDWIDTH, CostModel
from moe.comm.expert_exchange import all_to_all_splits
from moe.comm.topology import get_topology
from moe.dispatch.overlap_clock import EXPLORE
from moe.parallel import init_mesh, parallelize


def _slowest(*seconds: float) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _cpu_seconds() -> float:
    """CPU time of this process, all threads, user + system (the kernel's network path too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(op) -> tuple[float, float, float, float]:
    """(total, forward, backward, CPU) seconds of one call: the first three the slowest rank's
    (op() returns the moment its forward ended), CPU the sum over ranks."""
    dist.barrier()
    cpu = _cpu_seconds()
    start = time.perf_counter()
    forward_end = op()
    end = time.perf_counter()
    cpu = _cpu_seconds() - cpu
    total, fwd, bwd = _slowest(end - start, forward_end - start, end - forward_end)
    cpu_t = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(cpu_t)
    return total, fwd, bwd, float(cpu_t)


def _one_exchange(x, plan) -> float:
    exchange(x, plan)
    return time.perf_counter()


def fit_link(x_ND, send, N: int, L: int) -> CostModel:
    """t = a + b * S from exchanges of S and S / 4 bytes (max over ranks, median of 3), as a
    CostModel whose flat_time(S) is exactly a + b * S on this N x L layout."""
    W = N * L
    points = []
    for div in (1, 4):
        rows = [c // div for c in send]
        x = x_ND[: sum(rows)]
        plan = all_to_all_splits(x, rows, algorithm="flat")
        t = statistics.median(
            _timed(lambda x=x, plan=plan: _one_exchange(x, plan))[0] for _ in range(3)
        )
        points.append((max(sum(rows), 1) * x.shape[1] * x.element_size(), t))
    (s1, t1), (s2, t2) = points
    b = max((t1 - t2) / max(s1 - s2, 1), 1e-12)
    a = max(t1 - b * s1, 0.0)
    if N > 1:  # the bytes that leave the node set the time
        return CostModel(a, 0.0, MAX_BANDWIDTH, 0.0, (W - L) / W / b, MAX_BANDWIDTH, a)
    return CostModel(a, 0.0, (L - 1) / L / b, 0.0, MAX_BANDWIDTH, MAX_BANDWIDTH, a)


def worker_main(cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout"]))
    W, rank = dist.get_world_size(), dist.get_rank()
    D, F, E, T, K = cfg["d_model"], cfg["d_ff"], cfg["experts"], cfg["tokens"], cfg["top_k"]
    L = E // W
    mesh = init_mesh(dp=1, ep=W)
    load_before = os.getloadavg()[0]

    def make(overlap):
        torch.manual_seed(0)
        layer = moe.MoELayer(D, F, E, top_k=K, aux_loss_coef=0.0)
        return parallelize(layer, mesh, algorithm="flat", overlap=overlap)

    x = torch.randn(T, D, generator=torch.Generator().manual_seed(rank))
    degrees = [n for n in cfg["degrees"] if n <= L]
    models = {"plain": make(None), **{f"n={n}": make(n) for n in degrees}}

    def layer_op(model):
        def op():
            xx = x.clone().requires_grad_()
            y = model(xx)
            forward_end = time.perf_counter()
            y.sum().backward()
            model.zero_grad(set_to_none=True)
            return forward_end

        return op

    # The rows this layer exchanges and computes, for the exchange-alone and experts-alone.
    plain = models["plain"]
    layer_op(plain)()
    counts_WL = plain.stats["tokens_per_expert"].view(W, L)
    recv_WL = torch.empty_like(counts_WL)
    dist.all_to_all_single(recv_WL, counts_WL.contiguous())
    send = counts_WL.sum(1).tolist()
    rows = torch.randn(sum(send), D)
    plan = all_to_all_splits(rows, send, algorithm="flat")
    x_RD = torch.randn(int(recv_WL.sum()), D)
    offsets_L = torch.cumsum(recv_WL.sum(0), 0).to(torch.int32)

    def exchange_op():  # the layer's four exchanges: dispatch, combine and their gradients
        r = rows.clone().requires_grad_()
        y = exchange(exchange(r, plan), plan.reverse())
        forward_end = time.perf_counter()
        y.sum().backward()
        return forward_end

    def experts_op():
        xr = x_RD.clone().requires_grad_()
        y = plain.experts(xr, offsets_L)
        forward_end = time.perf_counter()
        y.sum().backward()
        plain.zero_grad(set_to_none=True)
        return forward_end

    topo = get_topology(ranks_per_node=cfg["ranks_per_node"])
    link = fit_link(rows, send, topo.num_nodes, topo.ranks_per_node)
    set_cost_model(link)
    models["auto"] = make("auto")
    ops = {name: layer_op(m) for name, m in models.items()}
    ops["exchange"], ops["experts"] = exchange_op, experts_op
    for name, op in ops.items():  # warm-up; auto: past its exploration (plain and pipelined
        # alternate until each has EXPLORE kept times), so its rounds show what it settles on
        for _ in range(cfg["warmup"] + (2 * (EXPLORE + 1) if name == "auto" else 0)):
            op()
    samples: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in ops}
    names = list(ops)
    auto_degrees = []  # the degree auto ran at in each measured call
    for r in range(cfg["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_timed(ops[name]))
            if name == "auto":
                auto_degrees.append(models["auto"].dispatcher.last_degree)

    def median(name, k):
        return statistics.median(t[k] for t in samples[name])

    result = {
        "rate_mbit": cfg["rate_mbit"],
        "burst_kb": cfg["burst_kb"],
        "median_s": {n: median(n, 0) for n in samples},
        "min_s": {n: min(t[0] for t in s) for n, s in samples.items()},
        "median_forward_s": {n: median(n, 1) for n in samples},
        "median_backward_s": {n: median(n, 2) for n in samples},
        "median_cpu_s": {n: median(n, 3) for n in samples},  # all ranks together
        "auto_degrees": auto_degrees,
        "link_model": {"a_s": link.a_coll, "bytes_per_s": link.bw_inter},
        "send_bytes": sum(send) * D * 4,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    if rank == 0:
        Path(cfg["json"]).write_text(json.dumps({"meta": cfg, "rows": [result]}, indent=1))
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
