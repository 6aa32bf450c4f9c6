"""Measurement in every rank (the sweep) and the local launcher (spawned gloo ranks)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.a2a.tables import console_line, console_tables
from moe.comm.alltoall import exchange
from moe.comm.expert_exchange import all_to_all, all_to_all_splits

ALGOS = ("raw", "flat", "hier", "flat*", "hier*", "raw+cnt")


def default_ranks_per_node(W: int) -> int:
    """Ranks per (emulated) node when all ranks share one host: 2 nodes when W is even and
    >= 4, so the hierarchical column compares something; else one node."""
    return W // 2 if W >= 4 and W % 2 == 0 else W


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def split_matrix(size: int, W: int, row_elems: int, elem: int, uneven: bool, seed: int):
    """counts_WW[src][dst] in rows of row_elems elements: even, or uneven with some zeros."""
    rows_per_peer = max(1, size // (W * row_elems * elem))
    if not uneven:
        return [[rows_per_peer] * W for _ in range(W)]
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(W, W, generator=g) * 2.0
    u[torch.rand(W, W, generator=g) < 0.1] = 0.0
    return (u * rows_per_peer).floor().long().tolist()


def _timed(op, iters: int, sync) -> float:
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    sync()
    return (time.perf_counter() - start) / iters


def measure_size(size: int, cfg: dict, device: torch.device, sync) -> dict:
    """Time every algorithm at one per-rank size; returns per-rank seconds (mean and max)."""
    W, rank = dist.get_world_size(), dist.get_rank()
    L = cfg["ranks_per_node"]
    elem = 4
    count = max(1, size // (W * elem))
    row_elems = min(count // 8 if cfg["uneven"] else count, 1024) or 1  # uneven: >= 8 rows/peer
    C = split_matrix(size, W, row_elems, elem, cfg["uneven"], seed=cfg["seed"] + size)
    send, recv = C[rank], [C[s][rank] for s in range(W)]
    x = torch.randn(sum(send), row_elems, device=device)
    flat_plan = all_to_all_splits(x, send, algorithm="flat")
    hier_plan = all_to_all_splits(x, send, algorithm="hierarchical", ranks_per_node=L)

    def raw():
        y = torch.empty(sum(recv), row_elems, device=device)
        dist.all_to_all_single(y, x, output_split_sizes=recv, input_split_sizes=send)

    def raw_counts():  # what a caller of all_to_all_single must do when splits are dynamic
        send_t = torch.tensor(send, device=device)
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t)
        recv_now = recv_t.tolist()
        y = torch.empty(sum(recv_now), row_elems, device=device)
        dist.all_to_all_single(y, x, output_split_sizes=recv_now, input_split_sizes=send)

    ops = {
        "raw": raw,
        "raw+cnt": raw_counts,
        "flat": lambda: all_to_all(x, send, algorithm="flat"),
        "hier": lambda: all_to_all(x, send, algorithm="hierarchical", ranks_per_node=L),
        "flat*": lambda: exchange(x, flat_plan),
        "hier*": lambda: exchange(x, hier_plan),
    }
    warm = torch.tensor([_timed(op, 1, sync) for op in ops.values()], dtype=torch.float64)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    iters = int(min(cfg["iters"], max(2, cfg["budget"] // max(float(warm.sum()), 1e-9))))
    rounds = min(cfg["rounds"], iters)
    per_round = max(1, iters // rounds)
    samples: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_timed(ops[name], per_round, sync))
    mine = torch.tensor([statistics.median(samples[n]) for n in names], dtype=torch.float64)
    total, worst = mine.clone(), mine.clone()
    dist.all_reduce(total)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    row_bytes = row_elems * elem
    max_bytes = max(sum(r) for r in C) * row_bytes
    reported = max_bytes if cfg["uneven"] else sum(send) * row_bytes
    times = (worst if cfg["uneven"] else total / W).tolist()
    return {
        "size": reported,
        "count": reported // (W * elem),
        "iters": rounds * per_round,
        "chunks": hier_plan.chunks,
        "time_us": {n: t * 1e6 for n, t in zip(names, times)},
        "time_max_us": {n: t * 1e6 for n, t in zip(names, worst.tolist())},
    }


def _progress(total: int):
    """A tqdm bar on a terminal; None when piped (then one line per size is printed)."""
    if not sys.stdout.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="size", file=sys.stdout)


def worker_main(cfg: dict) -> None:
    """One rank: init from torchrun-style env, sweep, rank 0 prints and writes cfg['json']."""
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    use_cuda = torch.cuda.is_available() and cfg.get("backend") != "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    W, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", W))
    L = cfg["ranks_per_node"] or (local if local < W else default_ranks_per_node(W))
    cfg = {**cfg, "ranks_per_node": L}
    rows = []
    if rank == 0:
        emulated = " (emulated: all ranks on one host)" if local >= W and W // L > 1 else ""
        print(
            f"# {W} ranks, {dist.get_backend()} on {device.type}, 2D layout {W // L}x{L}"
            f"{emulated}, {'uneven' if cfg['uneven'] else 'even'} splits, float32",
            flush=True,
        )
    sizes = sweep_sizes(cfg["min_bytes"], cfg["max_bytes"], cfg["factor"])
    bar = _progress(len(sizes)) if rank == 0 else None
    for size in sizes:
        row = measure_size(size, cfg, device, sync)
        rows.append(row)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{size} B")
        elif rank == 0:  # piped output: one line per finished size
            print(console_line(row, W, L), flush=True)
    if bar is not None:
        bar.close()
    if rank == 0:
        print(console_tables(rows, W, L), flush=True)
    if rank == 0 and cfg.get("json"):
        meta = {
            "world_size": W,
            "ranks_per_node": L,
            "backend": dist.get_backend(),
            "device": device.type,
            "uneven": cfg["uneven"],
        }
        Path(cfg["json"]).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, W: int, port: int, cfg: dict) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(W),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(W),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
        }
    )
    worker_main(cfg)


def run_local(cfg: dict) -> dict:
    """Spawn cfg['nproc'] gloo ranks on loopback; the 2D path uses cfg['ranks_per_node']."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    W, port = cfg["nproc"], _free_port()
    procs = [ctx.Process(target=_spawned, args=(r, W, port, cfg)) for r in range(W)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + cfg["wall_limit"]
    try:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"ranks failed or timed out (rank, exit code): {bad}")
    return json.loads(Path(cfg["json"]).read_text())
