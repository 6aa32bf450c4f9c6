"""MoELayer forward+backward against a dense FFN of the same active FLOPs and, with --peers,
against DeepSpeed-MoE, side by side in one run (round-robin interleaved, medians), with the
peak memory of each candidate (a fresh process each, see peak_memory.py), our layer compiled
vs eager, where our layer's time goes (bench/layer_stages.py: stages, the expert layout rule,
page faults), and the GPU projection of gpu_plan.py.

    python -m bench.moe_layer --peers [--tokens 4096 --iters 7 --no-compile]

Writes bench/results/<date>-cpu-moe-layer.md.
"""

import argparse
import json
import sys

import torch

from bench import peers
from bench.common import device_name, time_interleaved, write_report
from bench.gpu_plan import gpu_plan_table
from bench.layer_stages import padded_vs_ragged, page_fault_table, stage_table
from bench.peak_memory import measure, measure_here

SHAPES = [(8, 2, 1024), (64, 8, 256), (128, 8, 128)]  # E, k, d_ff (T=4096, d=512, gelu)


def build(name: str, d: int, F: int, E: int, k: int, available: dict):
    torch.manual_seed(0)
    if name in ("moe", "moe compiled"):
        layer = peers.ours(d, F, E, k)
        return torch.compile(layer) if name == "moe compiled" else layer
    if name == "dense":
        return peers.dense(d, F, E, k)
    return available[name](d, F, E, k)


def make_step(module, tokens: int, d: int):
    x = torch.randn(tokens, d, requires_grad=True)
    g = torch.randn(tokens, d)

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(g)

    return step


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peers", action="store_true", help="also DeepSpeed-MoE (and Tutel if present)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of our layer")
    p.add_argument("--memory-probe", nargs=6, metavar=("NAME", "D", "F", "E", "K", "T"))
    args = p.parse_args(argv)
    available, notes = peers.available_peers() if args.peers or args.memory_probe else ({}, [])
    if args.memory_probe:
        name, d, F, E, k, T = args.memory_probe
        module = build(name, int(d), int(F), int(E), int(k), available)
        step = make_step(module, int(T), int(d))
        print(json.dumps({"peak_bytes": measure_here(step, lambda: module.zero_grad(True))}))
        return ""
    T, d = args.tokens, args.d_model
    names = ["moe", "dense", *available] + ([] if args.no_compile else ["moe compiled"])
    rows = []
    for E, k, F in SHAPES:
        steps = {n: make_step(build(n, d, F, E, k, available), T, d) for n in names}
        t = time_interleaved(steps, args.iters, args.warmup, torch.device("cpu"))
        mem = {
            n: measure("bench.moe_layer", n, str(d), str(F), str(E), str(k), str(T)) for n in names
        }
        rows.append(((E, k, F), t, mem))
        print(f"E={E} k={k} F={F}: " + ", ".join(f"{n} {t[n]:.3f}s" for n in names), flush=True)
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.0f}"
    head = "| shape | " + " | ".join(f"{n} s" for n in names) + " | moe / dense | "
    head += " | ".join(f"{n} MiB" for n in names) + " |\n"
    head += "|---" * (2 * len(names) + 2) + "|\n"
    table = head + "".join(
        f"| E={E} k={k} d_ff={F} | "
        + " | ".join(f"{t[n]:.3f}" for n in names)
        + f" | {t['moe'] / t['dense']:.2f} | "
        + " | ".join(mib(m[n]) for n in names)
        + " |\n"
        for (E, k, F), t, m in rows
    )
    layout = [(E, k, F, *padded_vs_ragged(d, F, E, k, T)) for E, k, F in SHAPES]
    layout_table = "| shape | ragged ms | padded ms | padded slots per row |\n|---|---|---|---|\n"
    layout_table += "".join(
        f"| E={E} k={k} d_ff={F} | {r:.0f} | {p:.0f} | {pad:.3f} |\n"
        for E, k, F, r, p, pad in layout
    )
    stages = "".join(
        f"\n### E={E} k={k} d_ff={F}\n\n" + stage_table(build("moe", d, F, E, k, {}), T) + "\n"
        for E, k, F in SHAPES
    )
    report = (
        "# MoE layer forward+backward: moe vs dense FFN vs peers, side by side\n\n"
        f"- machine: {device_name(torch.device('cpu'))}, torch {torch.__version__}\n"
        f"- command: `python -m bench.moe_layer {' '.join(argv or sys.argv[1:])}`\n"
        f"- T={T} tokens, d_model={d}, gelu experts, fp32; moe is dropless, DeepSpeed runs at "
        "capacity factor 1.0 (it drops tokens past capacity, so it does less work); the dense "
        "FFN has width d_ff * k (the active FLOPs of one token); seconds per fwd+bwd, median "
        f"of {args.iters} round-robin iterations after {args.warmup} warm-up (compile "
        "included in the warm-up); MiB = bytes a fwd+bwd adds at its peak, measured in a "
        "fresh process per candidate (bench/peak_memory.py)\n"
        + "".join(f"- {n}\n" for n in notes)
        + f"\n{table}\n## Where our layer's time goes (one fwd+bwd, profiled)\n"
        + stages
        + "\n## Expert layout: ragged groups vs padded to the busiest expert\n\n"
        "The experts' fwd+bwd alone on the router's plan at init, through the same fused op "
        "(padded groups run as one bmm per chunk). Padding pays only where it is faster here; "
        "the layer pads nothing and runs equal groups (expert choice) as one bmm.\n\n"
        + layout_table
        + "\n## Why the experts work in chunks: fresh pages\n\n"
        + page_fault_table()
        + "\n\n## GPU plan (a projection, not a measurement)\n\n"
        + gpu_plan_table()
        + "\n"
    )
    print(table)
    print("report:", write_report("moe-layer", report, torch.device("cpu")))
    return report


if __name__ == "__main__":
    main()
