"""Benchmark of the M6 example: the default MoE run beside the dense FFN model of equal active
FLOPs, in one process and on 4 ranks (MoE: dp=2 x ep=2; dense: dp=4), on CPU and, when a
GPU is present, on it. Writes a dated markdown report to bench/results/.

    python examples/m6/bench.py                      # CPU: 4 runs of the default config
    python examples/m6/bench.py --steps 200 --no-ranks
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "m6" / "train.py"


def variants(args) -> list[tuple[str, int, list[str]]]:
    """(label, processes, extra arguments) of every run."""
    cpu = ["--device", "cpu"]  # --device auto would take a GPU where there is one
    runs = [("MoE", 1, cpu), ("dense", 1, ["--dense", *cpu])]
    if not args.no_ranks:
        runs += [
            ("MoE dp=2 ep=2", 4, ["--dp", "2", "--ep", "2", *cpu]),
            ("dense dp=4", 4, ["--dense", "--dp", "4", *cpu]),
        ]
    if torch.cuda.is_available() and not args.cpu_only:
        runs += [("MoE", 1, ["--device", "cuda"]), ("dense", 1, ["--dense", "--device", "cuda"])]
        gpu = ["--config", "m6-tiny-gpu", "--device", "cuda"]
        runs += [("MoE gpu-preset", 1, gpu), ("dense gpu-preset", 1, ["--dense", *gpu])]
    return runs


def run_one(label: str, procs: int, extra: list[str], args, workdir: Path) -> dict:
    flags = "_".join(a.strip("-").replace(":", "") for a in extra)
    run_dir = workdir / f"{label.replace(' ', '_').replace('=', '')}-{procs}-{flags}"
    common = ["--steps", str(args.steps), "--run-dir", str(run_dir), "--no-plots", "--quiet"]
    if procs == 1:
        cmd = [sys.executable, str(TRAIN), *common, *extra]
    else:
        cmd = ["torchrun", "--standalone", f"--nproc-per-node={procs}", str(TRAIN), *common, *extra]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(label=label, procs=procs, wall_s=wall, load=(load_before, os.getloadavg()[0]))
    print(f"{label:<16} settings: {summary.get('settings', '?')}", flush=True)
    print(
        f"{label:<16} {procs} proc  {summary['device']:<6} {summary['tokens_per_s']:>9,.0f} tok/s  "
        f"caption acc {100 * summary['caption_accuracy']:5.1f}%  held-out loss "
        f"{summary['heldout_loss']:.4f}  ({wall:.0f} s wall)",
        flush=True,
    )
    return summary


def _chance(summary: dict) -> str:
    c = summary.get("caption_chance")
    return f" (chance {100 / c['classes']:.1f}%: 1 of {c['classes']} captions)" if c else ""


def report(results: list[dict], args) -> str:
    first = results[0]["config"]
    lines = [
        f"# M6 example benchmark ({datetime.date.today().isoformat()})",
        "",
        f"Command: `python examples/m6/bench.py --steps {args.steps}`. Each row is one run of "
        f"`examples/m6/train.py` ({first['name']}, {args.steps} steps, global batch "
        f"{results[0].get('global_batch', 64)}, "
        "digits data); tokens/s counts every sequence position (16 image patches + 12 text "
        "positions) of the global batch over the training loop's wall time (evaluation excluded). "
        f"Caption accuracy: exact match of the greedy caption on the {results[0]['caption_total']} "
        f"held-out images{_chance(results[0])}. MoE: 8 experts in blocks 1 and 3, expert prototyping (2 prototypes of "
        "4 experts, top-1 in each), capacity factor 1.25; on 4 ranks through "
        "moe.parallel.parallelize. Dense: each MoE FFN replaced by one dense FFN of width "
        "top_k x d_ff = 256, the same active FLOPs per token (active parameters differ only by "
        "the routers); on 4 ranks DistributedDataParallel.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
        + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU")
        + ". The CPU cores are shared with other jobs: the load column is the 1-minute load "
        "average before/after each run, and CPU throughput varies with it.",
        "",
        "| model | ranks | layout | device | params (active) | tokens/s | caption acc | "
        "held-out loss | text-to-text acc | train time s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    settings = [f"- {r['label']} ({r['world']} rank(s)): {r.get('settings', '?')}" for r in results]
    at = lines.index("|---|---|---|---|---|---|---|---|---|---|---|") - 1  # the table's head
    lines[at:at] = ["Settings of each run (the example's settings line):", "", *settings, ""]
    for r in results:
        layout = f"dp={r['dp']} ep={r['ep']}"
        lines.append(
            f"| {r['label'].split()[0]} | {r['world']} | {layout} | {r['device']} | "
            f"{r['params']:,} ({r['active_params']:,}) | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['caption_accuracy']:.1f}% | {r['heldout_loss']:.4f} | "
            f"{100 * r['text_accuracy']:.1f}% | {r['time_s']:.1f} | "
            f"{r['load'][0]:.1f}/{r['load'][1]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--no-ranks", action="store_true", help="skip the 4-rank runs")
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--out", help="report path (default bench/results/<date>-<cpu|gpu>-m6.md)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_one(*v, args, Path(tmp)) for v in variants(args)]
    kind = "gpu" if any(r["device"].startswith("cuda") for r in results) else "cpu"
    out = Path(
        args.out or ROOT / "bench" / "results" / f"{datetime.date.today().isoformat()}-{kind}-m6.md"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(results, args))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
