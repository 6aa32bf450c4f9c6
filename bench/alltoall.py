"""All-to-all benchmark: raw all_to_all_single vs moe flat vs moe hierarchical, side by side.

nccl-tests alltoall_perf columns: size = bytes of one rank's whole send buffer, count = elements
per peer, time (us), algbw = size / time (GB/s), busbw = algbw * (n - 1) / n. Even splits: time
averaged over ranks; uneven splits (--uneven): size = the largest per-rank buffer, time = the
maximum over ranks. Each (size, algorithm) gets 1 warm-up and up to --iters timed iterations,
split into rounds interleaved across algorithms; a rank's time is the median round mean.

  python bench/alltoall.py                        # spawns 8 gloo ranks on loopback, 2D as 2x4
  torchrun --nproc-per-node 8 bench/alltoall.py   # under torchrun (NCCL when CUDA is present)
  python bench/alltoall.py --emulate 2x4          # two-tier network in network namespaces (root)
  python bench/alltoall.py --suite --report bench/results/DATE-cpu-alltoall.md   # the report
  python bench/alltoall.py --model-only           # alpha-beta projection only

Columns "flat" and "hier" time the full moe.dispatch.all_to_all call (validation, count
exchange, token exchange); "flat*" and "hier*" time moe.dispatch.exchange with a precomputed
plan, i.e. the token exchange alone (what the reverse exchanges of an MoE layer cost).

Emulated two-tier network (--emulate NxL): each node is a network namespace moe-nK with one
veth (10.77.0.K+1/24) into a bridge living in namespace moe-sw; both directions of every veth
carry a `tc tbf` rate limit (node NIC), so inter-node traffic is shaped while ranks of one node
talk over the namespace's loopback. Gloo binds to the node's veth (GLOO_SOCKET_IFNAME); rank
0's namespace hosts the store. tbf adds no propagation delay (netem is unavailable here).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe.comm.alltoall import (  # noqa: E402
    all_to_all,
    exchange,
    pipeline_chunks,
    plan_all_to_all,
)

ALGOS = ("raw", "flat", "hier", "flat*", "hier*", "raw+cnt")
NS_PREFIX = "moe-n"
NS_SWITCH = "moe-sw"
SUBNET = "10.77.0"

# ----------------------------------------------------------------------------------------------
# Measurement (runs in every rank)
# ----------------------------------------------------------------------------------------------


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
    flat_plan = plan_all_to_all(x, send, algorithm="flat")
    hier_plan = plan_all_to_all(x, send, algorithm="hierarchical", ranks_per_node=L)

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
    L = cfg["ranks_per_node"] or int(os.environ.get("LOCAL_WORLD_SIZE", W))
    cfg = {**cfg, "ranks_per_node": L}
    rows = []
    if rank == 0:
        print(
            f"# {W} ranks, {dist.get_backend()} on {device.type}, 2D layout {W // L}x{L}, "
            f"{'uneven' if cfg['uneven'] else 'even'} splits, float32",
            flush=True,
        )
        print(table_header(), flush=True)
    for size in sweep_sizes(cfg["min_bytes"], cfg["max_bytes"], cfg["factor"]):
        row = measure_size(size, cfg, device, sync)
        rows.append(row)
        if rank == 0:
            print(table_line(row, W), flush=True)
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


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def busbw(size: int, time_us: float, W: int) -> tuple[float, float]:
    algbw = size / (time_us * 1e-6) / 1e9
    return algbw, algbw * (W - 1) / W


def table_header() -> str:
    cols = "".join(f" | {n + ' time(us)':>15} {'algbw':>7} {'busbw':>7}" for n in ALGOS[:3])
    return (
        f"| {'size(B)':>10} {'count':>9} {'type':>5}{cols} | {'flat/raw t':>10} "
        f"{'hier/flat bw':>12} | {'flat*/raw t':>11} {'hier*/flat* bw':>14} |"
    )


def table_line(row: dict, W: int) -> str:
    t = row["time_us"]
    parts = []
    for n in ALGOS[:3]:
        a, b = busbw(row["size"], t[n], W)
        parts.append(f" | {t[n]:15.1f} {a:7.3f} {b:7.3f}")
    return (
        f"| {row['size']:10d} {row['count']:9d} {'float':>5}"
        + "".join(parts)
        + f" | {t['flat'] / t['raw']:10.3f} {t['flat'] / t['hier']:12.3f}"
        f" | {t['flat*'] / t['raw']:11.3f} {t['flat*'] / t['hier*']:14.3f} |"
    )


def table_separator() -> str:
    return "|" + "|".join("---" for _ in range(19)) + "|"


def markdown_table(rows: list[dict], W: int) -> str:
    """nccl-tests columns for raw / flat / hier, then the plan-reuse data path and ratios."""
    head = (
        "| size (B) | count | raw time (us) | raw algbw | raw busbw | flat time (us) | "
        "flat algbw | flat busbw | hier time (us) | hier algbw | hier busbw | raw+cnt time (us) |"
        " flat/raw time | flat/(raw+cnt) time | hier/flat busbw | flat* time (us) |"
        " hier* time (us) | hier* busbw | flat*/raw time | hier*/flat* busbw | chunks | iters |"
    )
    lines = [head, "|" + "---:|" * 22]
    for row in rows:
        t, S = row["time_us"], row["size"]
        cells = [str(S), str(row["count"])]
        for n in ALGOS[:3]:
            a, b = busbw(S, t[n], W)
            cells += [f"{t[n]:.1f}", f"{a:.4f}", f"{b:.4f}"]
        cells += [
            f"{t['raw+cnt']:.1f}",
            f"{t['flat'] / t['raw']:.3f}",
            f"{t['flat'] / t['raw+cnt']:.3f}",
            f"{t['flat'] / t['hier']:.3f}",
            f"{t['flat*']:.1f}",
            f"{t['hier*']:.1f}",
            f"{busbw(S, t['hier*'], W)[1]:.4f}",
            f"{t['flat*'] / t['raw']:.3f}",
            f"{t['flat*'] / t['hier*']:.3f}",
            str(row["chunks"]),
            str(row["iters"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Launchers: local spawn, torchrun, emulated two-tier network
# ----------------------------------------------------------------------------------------------


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


def _sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd.split(), check=check, capture_output=True, text=True)


def netns_available() -> str | None:
    """None if network namespaces can be created here, else the reason."""
    if os.geteuid() != 0:
        return "not root (needs CAP_NET_ADMIN for ip netns / tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2)"
    probe = f"{NS_PREFIX}probe"
    if _sh(f"ip netns add {probe}", check=False).returncode != 0:
        return "`ip netns add` failed (no privilege for network namespaces)"
    _sh(f"ip netns del {probe}", check=False)
    return None


def teardown_network(num_nodes: int) -> None:
    for k in range(num_nodes):
        _sh(f"ip netns del {NS_PREFIX}{k}", check=False)
    _sh(f"ip netns del {NS_SWITCH}", check=False)


def setup_network(num_nodes: int, rate_mbit: int, burst_kb: int, latency_ms: float) -> None:
    """Namespaces moe-n0.. (one per node) on a bridge in moe-sw; tbf both ways on each link."""
    teardown_network(num_nodes)  # leftovers of an interrupted run of this script
    tbf = f"tbf rate {rate_mbit}mbit burst {burst_kb}kb latency {latency_ms}ms"
    _sh(f"ip netns add {NS_SWITCH}")
    _sh(f"ip -n {NS_SWITCH} link add moe-br0 type bridge")
    _sh(f"ip -n {NS_SWITCH} link set moe-br0 up")
    for k in range(num_nodes):
        ns, node_if, sw_if = f"{NS_PREFIX}{k}", f"moe-v{k}", f"moe-b{k}"
        _sh(f"ip netns add {ns}")
        _sh(f"ip -n {ns} link set lo up")
        _sh(f"ip -n {ns} link add {node_if} type veth peer name {sw_if} netns {NS_SWITCH}")
        _sh(f"ip -n {ns} addr add {SUBNET}.{k + 1}/24 dev {node_if}")
        _sh(f"ip -n {ns} link set {node_if} up")
        _sh(f"ip -n {NS_SWITCH} link set {sw_if} master moe-br0")
        _sh(f"ip -n {NS_SWITCH} link set {sw_if} up")
        _sh(f"tc -n {ns} qdisc add dev {node_if} root {tbf}")  # node -> network
        _sh(f"tc -n {NS_SWITCH} qdisc add dev {sw_if} root {tbf}")  # network -> node


def tbf_stats(num_nodes: int) -> str:
    out = []
    for k in range(num_nodes):
        for ns, dev in ((f"{NS_PREFIX}{k}", f"moe-v{k}"), (NS_SWITCH, f"moe-b{k}")):
            text = _sh(f"tc -s -n {ns} qdisc show dev {dev}", check=False).stdout
            out.append(f"{ns}/{dev}: " + " ".join(text.split()))
    return "\n".join(out)


def run_emulated(cfg: dict) -> dict:
    """Run the sweep with N x L ranks in N namespaces joined by tbf-shaped veth links."""
    N, L = cfg["emulate"]
    setup_network(N, cfg["rate_mbit"], cfg["burst_kb"], cfg["latency_ms"])
    procs: list[subprocess.Popen] = []
    try:
        worker_cfg = {**cfg, "ranks_per_node": L}
        for rank in range(N * L):
            node = rank // L
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(N * L),
                "LOCAL_RANK": str(rank % L),
                "LOCAL_WORLD_SIZE": str(L),
                "MASTER_ADDR": f"{SUBNET}.1",
                "MASTER_PORT": "29611",
                "TORCH_CPP_LOG_LEVEL": "ERROR",
                "GLOO_SOCKET_IFNAME": f"moe-v{node}",
                "OMP_NUM_THREADS": "1",
            }
            cmd = [
                "ip",
                "netns",
                "exec",
                f"{NS_PREFIX}{node}",
                sys.executable,
                __file__,
                "--worker-config",
                json.dumps(worker_cfg),
            ]
            out = None if rank == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=out))
        deadline = time.monotonic() + cfg["wall_limit"]
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        stats = tbf_stats(N)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        teardown_network(N)
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"emulated ranks failed (rank, exit code): {bad}")
    result = json.loads(Path(cfg["json"]).read_text())
    result["meta"]["tbf_stats"] = stats
    return result


# ----------------------------------------------------------------------------------------------
# Alpha-beta cost model
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Per-rank alpha-beta model of one exchange.

    a_coll: fixed cost per collective call (launch, synchronisation); a_intra / a_inter: cost
    per message inside a node / across nodes (serialised: the reason fewer, larger network
    messages pay off); bw_intra / bw_inter: bytes per second one rank gets inside a node / on
    the network; bw_copy: bytes per second of a local re-layout (gather of the whole buffer);
    a_ring: cost of one step of a ring all_gather (the hierarchical count exchange).
    Flat: one collective, L-1 intra and W-L network messages of S/W bytes. Hierarchical with K
    pipeline chunks: K x (2 collectives, L-1 intra and N-1 network messages); intra-node bytes
    S(L-1)/L plus 2 re-layouts, network bytes S(N-1)/N, overlapped as max + min / K. With
    counts: flat adds one all_to_all_single of W counts, hierarchical a ring all_gather
    (one collective of W-1 steps).
    """

    a_coll: float
    a_intra: float
    bw_intra: float
    a_inter: float
    bw_inter: float
    bw_copy: float
    a_ring: float

    def vector(self) -> np.ndarray:
        return np.array(
            [
                self.a_coll,
                self.a_intra,
                1 / self.bw_intra,
                self.a_inter,
                1 / self.bw_inter,
                1 / self.bw_copy,
                self.a_ring,
            ]
        )


def flat_terms(S: float, N: int, L: int, counts: bool) -> np.ndarray:
    """Coefficients of [a_coll, a_intra, 1/bw_intra, a_inter, 1/bw_inter, 1/bw_copy, a_ring]."""
    W = N * L
    row = np.array([1, L - 1, S * (L - 1) / W, W - L, S * (W - L) / W, 0.0, 0])
    if counts:
        row += np.array([1, L - 1, 0, W - L, 0, 0, 0])
    return row


def hier_terms(S: float, N: int, L: int, K: int, counts: bool):
    """(fixed, intra-node, network) coefficient rows of the hierarchical exchange."""
    W = N * L
    fixed = K * np.array([2.0, L - 1, 0, N - 1, 0, 0, 0])
    if counts:
        fixed += np.array([1, 0, 0, 0, 0, 0, W - 1])
    intra = np.array([0, 0, S * (L - 1) / L, 0, 0, 2 * S, 0])
    inter = np.array([0, 0, 0, 0, S * (N - 1) / N, 0, 0])
    return fixed, intra, inter


def predict_flat(m: CostModel, S: float, N: int, L: int, counts: bool = False) -> float:
    return float(flat_terms(S, N, L, counts) @ m.vector())


def predict_hier(m: CostModel, S: float, N: int, L: int, K: int = 1, counts: bool = False):
    fixed, intra, inter = (t @ m.vector() for t in hier_terms(S, N, L, K, counts))
    return float(fixed + max(intra, inter) + min(intra, inter) / K)


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every support (7 unknowns: 127 subsets)."""
    best, best_err = np.zeros(A.shape[1]), float(np.sum(b**2))
    for k in range(1, A.shape[1] + 1):
        for support in itertools.combinations(range(A.shape[1]), k):
            sol, *_ = np.linalg.lstsq(A[:, support], b, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((A[:, support] @ sol - b) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(A.shape[1])
                best[list(support)] = sol
    return best


def fit_model(loopback: dict, emulated: dict) -> CostModel:
    """Fit on the loopback run (raw, hier*, full flat and hier) and emulated raw only; every
    hierarchical and every full-call measurement of the emulated run is left for the check.

    On one host both 2D stages are loopback traffic on the same CPU, so their network terms
    move to the intra-node columns and nothing overlaps. Rows are weighted by 1/time, so the
    fit minimises relative error.
    """
    A, b = [], []
    Wl, Ll = loopback["meta"]["world_size"], loopback["meta"]["ranks_per_node"]

    def one_host(row: np.ndarray) -> np.ndarray:
        return np.array([row[0], row[1] + row[3], row[2] + row[4], 0, 0, row[5], row[6]])

    for row in loopback["rows"]:
        S, t, K = row["size"], row["time_us"], row["chunks"]
        A.append(flat_terms(S, 1, Wl, False))
        b.append(t["raw"])
        A.append(flat_terms(S, 1, Wl, True))
        b.append(t["flat"])
        for counts, name in ((False, "hier*"), (True, "hier")):
            A.append(one_host(sum(hier_terms(S, Wl // Ll, Ll, K, counts))))
            b.append(t[name])
    We, Le = emulated["meta"]["world_size"], emulated["meta"]["ranks_per_node"]
    for row in emulated["rows"]:
        A.append(flat_terms(row["size"], We // Le, Le, False))
        b.append(row["time_us"]["raw"])
    A_, b_ = np.array(A), np.array(b) * 1e-6
    theta = nnls(A_ / b_[:, None], np.ones_like(b_))
    inv = [max(v, 1e-15) for v in theta]
    return CostModel(theta[0], theta[1], 1 / inv[2], theta[3], 1 / inv[4], 1 / inv[5], theta[6])


# Projection parameters for an H100-class cluster (stated assumptions, see the report).
GPU_CLUSTER = CostModel(
    a_coll=15e-6,  # NCCL launch + group synchronisation per collective
    a_intra=1.5e-6,  # per NVLink peer message
    bw_intra=450e9,  # NVLink per GPU per direction
    a_inter=4e-6,  # per RDMA message incl. NCCL proxy overhead
    bw_inter=50e9,  # 400 Gb/s NIC per GPU
    bw_copy=1.5e12,  # HBM re-layout (read + write of 3.35 TB/s)
    a_ring=4e-6,  # one ring step of NCCL all_gather across nodes
)


def model_check(model: CostModel, emulated: dict) -> list[dict]:
    """Predicted vs measured flat/hier time ratio (= hier/flat busbw) at every emulated size."""
    N = emulated["meta"]["world_size"] // emulated["meta"]["ranks_per_node"]
    L = emulated["meta"]["ranks_per_node"]
    out = []
    for row in emulated["rows"]:
        S, t, K = row["size"], row["time_us"], row["chunks"]
        entry = {"size": S, "chunks": K}
        for label, counts, f, h in (
            ("data", False, "flat*", "hier*"),
            ("full", True, "flat", "hier"),
        ):
            pf = predict_flat(model, S, N, L, counts)
            ph = predict_hier(model, S, N, L, K, counts)
            measured = t[f] / t[h]
            entry[label] = {
                "pred_flat_us": pf * 1e6,
                "pred_hier_us": ph * 1e6,
                "pred_ratio": pf / ph,
                "meas_ratio": measured,
                "rel_err": (pf / ph) / measured - 1,
            }
        out.append(entry)
    return out


def projection(model: CostModel, N: int, L: int, sizes: list[int]) -> list[dict]:
    rows = []
    for S in sizes:
        K = pipeline_chunks(S, N)
        r = {"size": S, "chunks": K}
        for counts, tag in ((False, "data"), (True, "full")):
            f = predict_flat(model, S, N, L, counts)
            h = predict_hier(model, S, N, L, K, counts)
            r[tag] = (f * 1e6, h * 1e6, f / h)
        rows.append(r)
    return rows


def projection_table(model: CostModel, N: int, L: int, sizes: list[int]) -> str:
    W = N * L
    lines = [
        f"Projection for {N} nodes x {L} GPUs (W = {W}):",
        "",
        "| size per rank (B) | flat* time (us) | hier* time (us) | hier*/flat* busbw | "
        "flat busbw (GB/s) | hier busbw (GB/s) | flat time incl. counts (us) | "
        "hier time incl. counts (us) | hier/flat incl. counts |",
        "|" + "---:|" * 9,
    ]
    for r in projection(model, N, L, sizes):
        f, h, ratio = r["data"]
        ff, hh, ratio_full = r["full"]
        lines.append(
            f"| {r['size']} | {f:.1f} | {h:.1f} | {ratio:.2f} | "
            f"{busbw(r['size'], f, W)[1]:.2f} | {busbw(r['size'], h, W)[1]:.2f} | "
            f"{ff:.1f} | {hh:.1f} | {ratio_full:.2f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def targets_section(results: dict[str, dict], model: CostModel | None) -> list[str]:
    """Each target of the issue with the measured numbers it is judged on."""
    out = ["## Targets (computed from the tables above)", ""]
    med = statistics.median
    for name, res in results.items():
        if res["meta"]["uneven"]:
            continue
        t = [r["time_us"] for r in res["rows"]]
        big = [r["time_us"] for r in res["rows"] if r["size"] >= 4 << 20] or t
        within = sum(abs(x["flat*"] / x["raw"] - 1) <= 0.05 for x in t)
        out.append(
            f"- flat within 5% of raw ({name}): data path flat*/raw median "
            f"{med(x['flat*'] / x['raw'] for x in t):.3f} (within 5% at {within}/{len(t)} "
            f"sizes); full call flat/raw median {med(x['flat'] / x['raw'] for x in t):.3f}, "
            f"largest sizes (>= 4 MiB) {med(x['flat'] / x['raw'] for x in big):.3f}; flat/(raw+cnt) median "
            f"{med(x['flat'] / x['raw+cnt'] for x in t):.3f}"
        )
    emu = results.get("emulated 2x4, even")
    if emu is not None:
        small = [r["time_us"] for r in emu["rows"] if r["size"] <= 256 << 10]
        full = [x["flat"] / x["hier"] for x in small]
        data = [x["flat*"] / x["hier*"] for x in small]
        out.append(
            f"- emulated 2x4, hier/flat busbw >= 1.3 up to 256 KiB: full call "
            f"{min(full):.2f}..{max(full):.2f}, data path {min(data):.2f}..{max(data):.2f}"
        )
        for r in emu["rows"]:
            if r["size"] == 16 << 20:
                x = r["time_us"]
                out.append(
                    f"- emulated 2x4, hier/flat busbw >= 0.9 at 16 MiB: full call "
                    f"{x['flat'] / x['hier']:.2f}, data path {x['flat*'] / x['hier*']:.2f}"
                )
        if model is not None:
            check = model_check(model, emu)
            worst_d = max(abs(e["data"]["rel_err"]) for e in check)
            worst_f = max(abs(e["full"]["rel_err"]) for e in check)
            n_ok = sum(abs(e["data"]["rel_err"]) <= 0.25 for e in check)
            out.append(
                f"- cost model ratio within 25% of measured: data path worst {worst_d:.0%} "
                f"({n_ok}/{len(check)} sizes within 25%), full call worst {worst_f:.0%}"
            )
    return out + [""]


def write_report(path: Path, results: dict[str, dict], cfgs: dict[str, dict], argv: str) -> None:
    lines = [
        f"# All-to-all on CPU (gloo): raw vs flat vs hierarchical — "
        f"{datetime.date.today().isoformat()}",
        "",
        f"Command: `{argv}`",
        "",
        f"Machine: {os.cpu_count()}-core CPU, torch {torch.__version__}, gloo over TCP; "
        "every rank uses 1 intra-op thread. Ranks oversubscribe the cores, so small-message "
        "times are dominated by process scheduling.",
        "",
    ]
    for name, res in results.items():
        meta, cfg = res["meta"], cfgs[name]
        W = meta["world_size"]
        lines += [
            f"## {name}",
            "",
            f"{W} ranks, 2D layout {W // meta['ranks_per_node']}x{meta['ranks_per_node']}, "
            f"{'uneven' if meta['uneven'] else 'even'} splits, float32, "
            f"sizes {cfg['min_bytes']}..{cfg['max_bytes']} B x{cfg['factor']}.",
            "",
        ]
        if "emulate" in name:
            lines += [
                f"tbf: rate {cfg['rate_mbit']} Mbit/s per direction per node link, "
                f"burst {cfg['burst_kb']} KiB, latency (queue bound) {cfg['latency_ms']} ms.",
                "",
                "tbf counters after the run:",
                "",
                "```",
                meta.get("tbf_stats", ""),
                "```",
                "",
            ]
        lines += [markdown_table(res["rows"], W), ""]
    model = None
    if "emulated 2x4, even" in results and "loopback 8 ranks, even" in results:
        emu, loop = results["emulated 2x4, even"], results["loopback 8 ranks, even"]
        model = fit_model(loop, emu)
        lines += [
            "## Cost model",
            "",
            "Fitted on the loopback run (raw, flat, hier*, hier) and the emulated raw column only:",
            "",
            "```",
            json.dumps(asdict(model), indent=1),
            "```",
            "",
            "| size (B) | pred flat* (us) | pred hier* (us) | pred ratio | measured ratio "
            "| rel. err | pred ratio incl. counts | measured incl. counts | rel. err |",
            "|" + "---:|" * 9,
        ]
        for e in model_check(model, emu):
            d, f = e["data"], e["full"]
            lines.append(
                f"| {e['size']} | {d['pred_flat_us']:.0f} | {d['pred_hier_us']:.0f} | "
                f"{d['pred_ratio']:.3f} | {d['meas_ratio']:.3f} | {d['rel_err']:+.1%} | "
                f"{f['pred_ratio']:.3f} | {f['meas_ratio']:.3f} | {f['rel_err']:+.1%} |"
            )
        lines += [
            "",
            "```",
            json.dumps(asdict(GPU_CLUSTER), indent=1),
            "```",
            "",
            projection_table(GPU_CLUSTER, 60, 8, sweep_sizes(1 << 10, 1 << 26, 4)),
            "",
        ]
    lines += targets_section(results, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=8, help="ranks to spawn when not under torchrun")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="2D layout for the hierarchical path (default: LOCAL_WORLD_SIZE, or 4 "
        "for spawned ranks)",
    )
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=1 << 26)
    p.add_argument("--factor", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=4.0, help="target seconds per size")
    p.add_argument("--emulated-budget", type=float, default=20.0, help="same, emulated runs")
    p.add_argument("--uneven", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout (s)")
    p.add_argument("--wall-limit", type=float, default=1800.0)
    p.add_argument("--backend", default=None, help="force gloo under torchrun with CUDA")
    p.add_argument("--emulate", default=None, help="NxL: emulated two-tier network (root)")
    p.add_argument("--rate-mbit", type=int, default=1000)
    p.add_argument("--burst-kb", type=int, default=32)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--emulated-max-bytes", type=int, default=1 << 26)
    p.add_argument(
        "--suite",
        action="store_true",
        help="loopback even+uneven and emulated 2x4 even+uneven, then the model",
    )
    p.add_argument("--report", default=None, help="write a markdown report here")
    p.add_argument("--json", default=None)
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--from-json", default=None, help="rewrite --report from a saved run")
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def base_cfg(a: argparse.Namespace) -> dict:
    return {
        "nproc": a.nproc,
        "ranks_per_node": a.ranks_per_node,
        "min_bytes": a.min_bytes,
        "max_bytes": a.max_bytes,
        "factor": a.factor,
        "iters": a.iters,
        "rounds": a.rounds,
        "budget": a.budget,
        "uneven": a.uneven,
        "seed": a.seed,
        "timeout": a.timeout,
        "wall_limit": a.wall_limit,
        "backend": a.backend,
        "rate_mbit": a.rate_mbit,
        "burst_kb": a.burst_kb,
        "latency_ms": a.latency_ms,
        "json": a.json,
    }


def _with_signals_as_exit() -> None:
    """SIGTERM/SIGHUP run the finally blocks (namespace teardown) like Ctrl-C does."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker_config:
        worker_main(json.loads(a.worker_config))
        return 0
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        write_report(Path(a.report), saved["results"], saved["cfgs"], saved["argv"])
        return 0
    if a.model_only:
        print(projection_table(GPU_CLUSTER, 60, 8, sweep_sizes(1 << 10, 1 << 26, 4)))
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        worker_main(base_cfg(a))
        return 0
    _with_signals_as_exit()
    runs: list[tuple[str, dict]] = []
    cfg = base_cfg(a)
    cfg["ranks_per_node"] = a.ranks_per_node or 4
    if a.suite:
        for uneven in (False, True):
            tag = "uneven" if uneven else "even"
            runs.append((f"loopback {a.nproc} ranks, {tag}", {**cfg, "uneven": uneven}))
        for uneven in (False, True):
            tag = "uneven" if uneven else "even"
            runs.append(
                (
                    f"emulated 2x4, {tag}",
                    {
                        **cfg,
                        "uneven": uneven,
                        "emulate": (2, 4),
                        "max_bytes": a.emulated_max_bytes,
                        "budget": a.emulated_budget,
                    },
                )
            )
    elif a.emulate:
        N, L = (int(v) for v in a.emulate.lower().split("x"))
        runs.append(
            (
                f"emulated {N}x{L}, {'uneven' if a.uneven else 'even'}",
                {**cfg, "emulate": (N, L), "max_bytes": min(a.max_bytes, a.emulated_max_bytes)},
            )
        )
    else:
        runs.append((f"loopback {a.nproc} ranks, {'uneven' if a.uneven else 'even'}", cfg))
    results, cfgs = {}, {}
    tmp = Path(tempfile.mkdtemp(prefix="moe-a2a-"))
    try:
        for name, run_cfg in runs:
            run_cfg = {**run_cfg, "json": str(tmp / f"{len(results)}.json")}
            print(f"\n## {name}", flush=True)
            if "emulate" in run_cfg:
                reason = netns_available()
                if reason is not None:
                    print(f"SKIPPED emulated network: {reason}", flush=True)
                    continue
                results[name] = run_emulated(run_cfg)
                print(results[name]["meta"]["tbf_stats"], flush=True)
            else:
                results[name] = run_local(run_cfg)
            cfgs[name] = run_cfg
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.report:
        command = "python bench/alltoall.py " + " ".join(sys.argv[1:] if argv is None else argv)
        saved = {"results": results, "cfgs": cfgs, "argv": command}
        Path(a.report).with_suffix(".json").write_text(json.dumps(saved, indent=1))
        write_report(Path(a.report), results, cfgs, command)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
