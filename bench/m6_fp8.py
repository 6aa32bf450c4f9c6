"""The M6 example trained with FP8 (dispatch and experts, `--fp8 all`) against its baselines,
side by side in one run (issue 40): same config, seed, data order and steps; loss curves,
final training loss (last step and the mean of the last 20) and held-out accuracy.

    PYTHONPATH=. python -m bench.m6_fp8 --steps 500 --report bench/results/DATE-cpu-m6-fp8.md

Runs (each one process, `examples/m6/train.py` in this process, one after the other):
  fp32            the example's CPU default (--precision auto = fp32 on the CPU)
  bf16            --precision bf16 (bf16 autocast of the forward passes, fp32 masters)
  FP8 + bf16      --precision bf16 --fp8 all
  FP8 + fp32      --fp8 all
FP8 on the CPU is moe.fp8's emulation (quantize -> dequantize -> float32 GEMM): the same
quantized products a GPU's e4m3 GEMMs compute, not their speed.
"""

import argparse
import datetime
import os
import platform
import sys
import tempfile
import textwrap
import time
from pathlib import Path

RUNS = (
    ("fp32", []),
    ("bf16", ["--precision", "bf16"]),
    ("FP8 + bf16", ["--precision", "bf16", "--fp8", "all"]),
    ("FP8 + fp32", ["--fp8", "all"]),
)
TAIL = 20  # steps averaged for the final training loss


def train_all(args, work: Path) -> dict[str, dict]:
    from examples.m6 import train

    out = {}
    for name, extra in RUNS:
        argv = ["--config", args.config, "--steps", str(args.steps), "--seed", str(args.seed),
                "--run-dir", str(work / name.replace(" ", "")), "--quiet", "--no-plots",
                *extra]  # fmt: skip
        t0 = time.perf_counter()
        s = train.run(argv)
        s["wall_s"] = time.perf_counter() - t0
        print(f"{name}: settings: {s['settings']}", flush=True)
        print(f"{name}: final loss {s['final_loss']:.4f}, held-out accuracy "
              f"{100 * s['caption_accuracy']:.1f}% ({s['caption_correct']}/{s['caption_total']}), "
              f"{s['wall_s']:.0f} s", flush=True)  # fmt: skip
        out[name] = s
    return out


def smoothed(losses: list[float], window: int = TAIL) -> list[float]:
    """Mean of the last `window` losses at each step (the curves' noise averaged out)."""
    out, total = [], 0.0
    for i, v in enumerate(losses):
        total += v - (losses[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict[str, dict], path: Path, config: str) -> None:
    """Top: every run's training loss (log scale), where the four curves lie on top of each
    other; bottom: each run's loss relative to bf16's (both smoothed over TAIL steps), in %,
    where their differences show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    base = smoothed(results["bf16"]["losses"])
    for name, s in results.items():
        steps = range(1, len(s["losses"]) + 1)
        ax.plot(steps, s["losses"], lw=0.8, label=name)
        if name != "bf16":
            rel = [100 * (a / b - 1) for a, b in zip(smoothed(s["losses"]), base)]
            diff.plot(steps, rel, lw=1, label=f"{name} vs bf16")
    ax.set_yscale("log")
    ax.set_ylabel("training loss\n(cross-entropy / token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    diff.axhline(0, color="0.4", lw=0.8)
    diff.set_ylabel(f"loss vs bf16, %\n(means of {TAIL} steps)")
    diff.set_xlabel("step")
    diff.grid(alpha=0.3)
    diff.legend(fontsize=8)
    fp8 = next((s["settings"] for n, s in results.items() if "FP8" in n), "")
    fig.suptitle(
        f"{config} on digits: FP8 against bf16 and fp32, one process on the CPU\n"
        + textwrap.fill(f"FP8 runs: {fp8}", 100),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: dict[str, dict], args, png: str) -> str:
    base = results["bf16"]
    tail = lambda s: sum(s["losses"][-TAIL:]) / len(s["losses"][-TAIL:])  # noqa: E731
    rows = []
    for name, s in results.items():
        rows.append(
            f"| {name} | {s['final_loss']:.4f} | "
            f"{100 * (s['final_loss'] / base['final_loss'] - 1):+.2f}% | {tail(s):.4f} | "
            f"{100 * (tail(s) / tail(base) - 1):+.2f}% | {100 * s['caption_accuracy']:.2f} | "
            f"{100 * (s['caption_accuracy'] - base['caption_accuracy']):+.2f} | "
            f"{s['heldout_loss']:.4f} | {s['wall_s']:.0f} |"
        )
    today = datetime.date.today().isoformat()
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores ({platform.platform(terse=True)})"
    settings = [f"- {name}: {s['settings']}" for name, s in results.items()]
    return "\n".join([
        f"# M6 example with FP8 against bf16 ({today}, CPU)", "",
        f"Command: `PYTHONPATH=. python -m bench.m6_fp8 {' '.join(args.argv)}` on {machine} "
        "(wall times are not a speed comparison: the CPU emulates FP8, and other jobs may share it).",
        f"Config {args.config}, {args.steps} steps, seed {args.seed}, global batch "
        f"{base['global_batch']} (the example's defaults otherwise), one process. FP8 = "
        "`--fp8 all`, emulated on the CPU (the same quantized products, float32 accumulation). "
        "What each run computed (the example's settings line):", "",
        *settings, "",
        f"![loss curves]({png})", "",
        f"Final loss: the last step's; tail: the mean of the last {TAIL} steps' training "
        "losses (vs bf16: relative); held-out: caption accuracy on the held-out digits "
        "(points vs bf16) and held-out loss.", "",
        "| run | final loss | vs bf16 | tail loss | tail vs bf16 | held-out acc % | "
        "vs bf16 (points) | held-out loss | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows, "",
    ])  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="m6-tiny")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", help="write the report (and a PNG beside it) here")
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        results = train_all(args, Path(tmp))
    if args.report:
        md = Path(args.report)
        png = md.with_suffix(".png")
        plot(results, png, args.config)
        md.write_text(report(results, args, png.name))
        print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
