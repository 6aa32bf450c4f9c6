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
import sys
import tempfile
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
        print(f"{name}: final loss {s['final_loss']:.4f}, held-out accuracy "
              f"{s['caption_accuracy']:.4f}, {s['wall_s']:.0f} s", flush=True)  # fmt: skip
        out[name] = s
    return out


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in results.items():
        ax.plot(range(1, len(s["losses"]) + 1), s["losses"], lw=0.8, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("M6 tiny on digits: FP8 (dispatch + experts) against bf16 and fp32, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    return "\n".join([
        f"# M6 example with FP8 against bf16 ({today}, CPU)", "",
        f"Command: `PYTHONPATH=. python -m bench.m6_fp8 {' '.join(args.argv)}` on the 2-core "
        "CPU machine (shared with other jobs: the wall times are not a speed comparison).",
        f"Config {args.config}, {args.steps} steps, seed {args.seed}, global batch 64 (the "
        "example's defaults otherwise), one process. FP8 = `--fp8 all`: token rows quantized "
        "as the FP8 dispatch sends them (e4m3, 1x128 fp32 scales) and every expert GEMM in "
        "e4m3 (rowwise, power-of-two scales), emulated on the CPU (the same quantized "
        "products, float32 accumulation). **bf16 here is the example's `--precision bf16`** "
        "(bf16 autocast of the forward passes, fp32 masters and optimizer state); the CPU "
        "default is fp32 (`--precision auto`).", "",
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
        plot(results, png)
        md.write_text(report(results, args, png.name))
        print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
