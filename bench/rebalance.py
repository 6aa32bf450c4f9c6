"""Load-aware expert placement on skewed routing: largest / mean rank load before and after
moe.parallel.choose_placement, then with replicas (moe.slots.replica_placement.choose_replicas,
--spare-slots per layer, default one per rank), and the MoE-layer step time that implies.

    python -m bench.rebalance [--m6-trace runs/x/routing_trace.jsonl] [--write]
    [--spare-slots R]

Replica columns: largest / mean after placement + R replicas, the lower bound for that R
(max(mean, the largest load per copy of the best copy counts)), experts with more than one
copy, slots changed from the identity layout, extra memory per rank (R / W expert slots:
bf16 weights and gradients, fp32 master and two AdamW moments, 16 bytes per parameter, since
every copy keeps its own state), and the bytes each rank sends per step to sum the copies'
gradients (one all-reduce of the replicated experts' bf16 gradients over the W ranks: a
ring sends 2 (W - 1) / W of it).

Loads: the per-expert load of a trained M6 run (its routing trace's routed_per_expert,
--m6-trace; or history["load"] in an older checkpoint's state.json, --m6-state: the share of
rows per expert each step, averaged over the last --m6-steps steps), and Zipf-distributed synthetic loads (share of expert i ~ 1 / rank_i^s over a random
order of the experts: hot experts land on ranks by chance) at E = 64 and 128 over W = 8 ranks.

Step time of one MoE layer from the busiest rank (nothing overlapped): its expert GEMMs,
rows x 6 d F n_mats flops (forward + backward) at a GEMM rate measured here on this CPU
(torch.matmul [rows, d] x [d, F] in float32), plus four all-to-alls (dispatch and combine,
forward and backward) of its rows x d x 2 bytes, priced by moe.comm.cost_model's NVLINK_IB
model on one node of 8. The GPU column uses an assumed H100 bf16 rate: a projection.
"""

import argparse
import json
import random
import time

import torch

from bench.common import write_report
from moe.comm.cost_model import NVLINK_IB
from moe.slots.layout import initial_expert_of_slot
from moe.slots.placement import choose_placement, rank_loads
from moe.slots.replica_placement import choose_replicas
from moe.slots.replica_placement import rank_loads as replica_rank_loads

H100_BF16_FLOPS = 600e12  # assumed achieved dense bf16 GEMM rate: a projection, not measured


def zipf_load(E: int, s: float, seed: int = 0) -> list[float]:
    order = list(range(E))
    random.Random(seed).shuffle(order)
    weights = [1.0 / (order[e] + 1) ** s for e in range(E)]
    total = sum(weights)
    return [w / total for w in weights]


def m6_loads(path: str, last: int) -> dict[str, list[float]]:
    with open(path) as f:
        history = json.load(f)["history"]
    out = {}
    for name, per_step in history["load"].items():
        rows = per_step[-last:]
        out[name] = [sum(r[e] for r in rows) / len(rows) for e in range(len(rows[0]))]
    return out


def m6_trace_loads(path: str, last: int) -> dict[str, list[float]]:
    """Per layer: each expert's share of the routed rows (routed_per_expert) of the last
    `last` steps of an M6 run's routing trace, read through moe.trace.routing_trace.read_trace."""
    from moe.trace.routing_trace import read_trace

    steps: dict[str, list[list[int]]] = {}
    for record in read_trace(path):
        if "routed_per_expert" in record:
            steps.setdefault(record["layer"], []).append(record["routed_per_expert"])
    out = {}
    for name, per_step in steps.items():
        rows = per_step[-last:]
        shares = [[c / max(1, sum(r)) for c in r] for r in rows]
        out[name] = [sum(r[e] for r in shares) / len(shares) for e in range(len(shares[0]))]
    return out


def gemm_rate(d: int, F: int, rows: int = 4096, iters: int = 5) -> float:
    """Measured float32 matmul flop/s on this machine."""
    a, b = torch.randn(rows, d), torch.randn(d, F)
    a @ b
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * rows * d * F * iters / (time.perf_counter() - start)


def layer_time(rows: float, d: int, F: int, n_mats: int, flops: float, ranks: int) -> float:
    gemm = rows * 6 * d * F * n_mats / flops
    a2a = NVLINK_IB.flat_time(rows * d * 2, 1, ranks, counts=True)
    return gemm + 4 * a2a


def replica_cells(load, W, R, scale, d, F, n_mats, cpu_rate) -> str:
    """The replica columns of one row (see the module docstring)."""
    E = len(load)
    q = choose_replicas(load, initial_expert_of_slot(E, R), W, min_gain=0.0)
    check = max(replica_rank_loads(load, q.expert_of_slot, W)) / q.mean
    assert abs(check - q.max_after / q.mean) < 1e-9
    copied = sum(c > 1 for c in q.copies)
    params = n_mats * d * F  # one expert
    extra_mb = R / W * params * 16 / 2**20
    grad_mb = 2 * (W - 1) / W * copied * params * 2 / 2**20
    rows = q.max_after * scale
    cpu, gpu = (layer_time(rows, d, F, n_mats, rate, W) for rate in (cpu_rate, H100_BF16_FLOPS))
    return (
        f"{q.max_after / q.mean:.3f} | {max(q.mean, q.bound) / q.mean:.3f} | {copied} | "
        f"{len(q.moved_slots)} | {extra_mb:.0f} | {grad_mb:.0f} | {cpu * 1e3:.1f} | {gpu * 1e3:.3f} |"
    )


def row(label, load, W, tokens_rows, d, F, n_mats, cpu_rate, R=0):
    E = len(load)
    p = choose_placement(load, list(range(E)), W, min_gain=0.0)
    mean = p.mean
    L = E // W  # the hottest expert's rank also holds L - 1 others, at least the coldest
    bound = max(mean, max(load) + sum(sorted(load)[: L - 1])) / mean
    scale = tokens_rows / sum(load)  # rows per unit of load
    before_rows, after_rows = p.max_before * scale, p.max_after * scale
    times = {
        dev: (
            layer_time(before_rows, d, F, n_mats, rate, W),
            layer_time(after_rows, d, F, n_mats, rate, W),
        )
        for dev, rate in (("cpu", cpu_rate), ("gpu", H100_BF16_FLOPS))
    }
    check = max(rank_loads(load, p.slot_of_expert, W)) / mean
    assert abs(check - p.max_after / mean) < 1e-9
    return (
        f"| {label} | {E} | {W} | {p.max_before / mean:.3f} | {p.max_after / mean:.3f} | "
        f"{bound:.3f} | {len(p.moved)} | "
        f"{times['cpu'][0] * 1e3:.1f} -> {times['cpu'][1] * 1e3:.1f} ({times['cpu'][0] / times['cpu'][1]:.2f}x) | "
        f"{times['gpu'][0] * 1e3:.3f} -> {times['gpu'][1] * 1e3:.3f} ({times['gpu'][0] / times['gpu'][1]:.2f}x) |"
        + (" " + replica_cells(load, W, R, scale, d, F, n_mats, cpu_rate) if R else "")
    )


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m6-state", help="state.json of an M6 checkpoint (history of loads)")
    ap.add_argument(
        "--m6-trace", help="routing_trace.jsonl of an M6 run (per-step routed rows per expert)"
    )
    ap.add_argument("--m6-steps", type=int, default=50, help="average the last n steps")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=4096)
    ap.add_argument("--spare-slots", type=int, default=None, help="R (default: one per rank)")
    ap.add_argument(
        "--write", action="store_true", help="write bench/results/<date>-cpu-replicas.md"
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    W, d, F = args.ranks, args.d_model, args.d_ff
    rows = args.tokens * args.top_k * W
    R = W if args.spare_slots is None else args.spare_slots
    if R < 0 or R % W:
        ap.error(f"--spare-slots must be a non-negative multiple of --ranks={W}, got {R}")
    cpu_rate = gemm_rate(d, F)
    head = (
        "| load | E | W | max/mean before | after | bound | experts moved | "
        "layer ms CPU (measured rate) | layer ms H100 (projection) |"
        + (
            f" + {R} replicas | bound R={R} | experts copied | slots moved | extra MiB/rank | "
            "grad-sum MiB/rank/step | layer ms CPU | layer ms H100 (projection) |"
            if R
            else ""
        )
        + "\n|"
        + "---|" * (9 + 8 * bool(R))
    )
    lines = [head]
    m6 = {}
    if args.m6_state:
        m6.update(m6_loads(args.m6_state, args.m6_steps))
    if args.m6_trace:
        m6.update(m6_trace_loads(args.m6_trace, args.m6_steps))
    if m6:
        for name, load in m6.items():
            lines.append(row(f"M6 {name}", load, W, rows, d, F, 2, cpu_rate, R))
    for E in (64, 128):
        for s in (0.6, 0.8, 1.0, 1.2):
            lines.append(row(f"Zipf s={s}", zipf_load(E, s), W, rows, d, F, 2, cpu_rate, R))
    text = "\n".join(lines)
    setup = (
        f"W={W} ranks, {args.tokens} tokens/rank, k={args.top_k} -> {rows} rows per step; "
        f"d={d}, F={F}, gelu (2 matrices); CPU float32 GEMM rate measured here: "
        f"{cpu_rate / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads); spare slots R={R}; "
        f"H100 rate assumed {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s (projection)"
    )
    print(setup)
    print(text)
    if args.write:
        print(write_report("replicas", f"{setup}\n\n{text}\n", torch.device("cpu")))
    return text


if __name__ == "__main__":
    main()
