"""Load-aware expert placement on skewed routing: largest / mean rank load before and after
moe.parallel.plan_placement, and the MoE-layer step time that implies.

    python -m bench.rebalance [--m6-state runs/x/checkpoint/step-N/state.json] [--write]

Loads: the per-expert load of a trained M6 run (history["load"] in a checkpoint's
state.json: the share of rows per expert each step, averaged over the last --m6-steps
steps), and Zipf-distributed synthetic loads (share of expert i ~ 1 / rank_i^s over a random
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
from moe.parallel.placement import plan_placement, rank_loads

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


def row(label, load, W, tokens_rows, d, F, n_mats, cpu_rate):
    E = len(load)
    p = plan_placement(load, list(range(E)), W, min_gain=0.0)
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
    )


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m6-state", help="state.json of an M6 checkpoint (history of loads)")
    ap.add_argument("--m6-steps", type=int, default=50, help="average the last n steps")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=4096)
    ap.add_argument(
        "--write", action="store_true", help="write bench/results/<date>-cpu-rebalance.md"
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    W, d, F = args.ranks, args.d_model, args.d_ff
    rows = args.tokens * args.top_k * W
    cpu_rate = gemm_rate(d, F)
    head = (
        "| load | E | W | max/mean before | after | bound | experts moved | "
        "layer ms CPU (measured rate) | layer ms H100 (projection) |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    if args.m6_state:
        for name, load in m6_loads(args.m6_state, args.m6_steps).items():
            lines.append(row(f"M6 {name}", load, W, rows, d, F, 2, cpu_rate))
    for E in (64, 128):
        for s in (0.6, 0.8, 1.0, 1.2):
            lines.append(row(f"Zipf s={s}", zipf_load(E, s), W, rows, d, F, 2, cpu_rate))
    text = "\n".join(lines)
    setup = (
        f"W={W} ranks, {args.tokens} tokens/rank, k={args.top_k} -> {rows} rows per step; "
        f"d={d}, F={F}, gelu (2 matrices); CPU float32 GEMM rate measured here: "
        f"{cpu_rate / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads); "
        f"H100 rate assumed {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s (projection)"
    )
    print(setup)
    print(text)
    if args.write:
        print(write_report("rebalance", f"{setup}\n\n{text}\n", torch.device("cpu")))
    return text


if __name__ == "__main__":
    main()
