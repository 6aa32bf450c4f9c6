"""Pipeline schedules: step time, measured bubble and peak memory per stage of an MoE stack
under moe.pipeline.Pipeline, for each of PyTorch's schedules at pp = 2 and 4, next to each
schedule's theoretical bubble, on the emulated two-tier network of bench.overlap.

  python -m bench.pipeline --out bench/results/DATE-cpu-pipeline

Every pipeline stage is one node of the emulated network (a network namespace, root: ip netns
and tc), its dp x ep ranks on the node's loopback, stages joined by veth links shaped by
`tc tbf` both ways (--rate Mbit/s); --loopback, or no network namespaces here, runs all ranks
on this machine's loopback instead (the results say which). One process per rank, one intra-op
thread each. Writes OUT.json (every rank of every case), OUT.md (the tables) and OUT.png.
How busy time, bubble and memory are measured: bench/pipeline_bench/worker.py; the
theoretical bubbles and their sources: bench/pipeline_bench/theory.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from bench.pipeline_bench.report import summarize, write_outputs

SCHEDULE_NAMES = "GPipe,1F1B,Interleaved1F1B,InterleavedZeroBubble,ZBVZeroBubble,DualPipeV"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", default="2,4", help="pipeline sizes (ranks per pipeline), ep=dp=1")
    p.add_argument("--ep2", action="store_true", help="add the layout pp=2, ep=2 (4 ranks)")
    p.add_argument(
        "--ep2-schedules", default="1F1B,DualPipeV", help="the schedules of the pp=2, ep=2 layout"
    )
    p.add_argument("--microbatches", default="4,8", help="micro-batch counts m per step")
    p.add_argument("--schedules", default=SCHEDULE_NAMES, help="moe.pipeline.SCHEDULES names")
    p.add_argument("--blocks", type=int, default=8, help="MoE blocks (split evenly by stage)")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--d-ff", type=int, default=256, help="expert FFN width")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--vocab", type=int, default=512, help="embedding / head size")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--microbatch-rows", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=4, help="timed rounds (one step per case)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per case first")
    p.add_argument("--loopback", action="store_true", help="no emulated network: loopback")
    p.add_argument("--rate", type=int, default=200, help="emulated link speed, Mbit/s")
    p.add_argument("--burst-kb", type=int, default=128, help="tbf bucket (see bench.overlap)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="tbf queue limit, ms")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, s")
    p.add_argument("--wall-limit", type=float, default=600.0, help="per layout, s")
    p.add_argument("--note", default="", help="a line for the report (machine state)")
    p.add_argument("--out", default=None, help="PATH prefix: writes PATH.json/.md/.png")
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def rerun_command(argv: list[str]) -> str:
    """The command line that reruns this benchmark (without --note: it described the run)."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--note="):
            skip = False
        elif arg == "--note":
            skip = True
        else:
            kept.append(arg)
    return shlex.join(["python", "-m", "bench.pipeline", *kept])


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker_config:
        from bench.pipeline_bench.worker import worker_main

        worker_main(json.loads(a.worker_config))
        return 0
    from bench.a2a.netem import netns_available
    from bench.pipeline_bench.launch import run_emulated, run_loopback
    from moe.pipeline import SCHEDULES

    schedules = [s for s in a.schedules.split(",") if s]
    ep2_schedules = [s for s in a.ep2_schedules.split(",") if s]
    unknown = [s for s in schedules + ep2_schedules if s not in SCHEDULES]
    if unknown:
        raise SystemExit(f"--schedules: unknown {unknown}; known: {', '.join(SCHEDULES)}")
    layouts = [(pp, 1, 1) for pp in _ints(a.pp)] + ([(2, 1, 2)] if a.ep2 else [])
    reason = "--loopback" if a.loopback else netns_available()
    network = "loopback" if reason else f"emulated ({a.rate} Mbit/s tbf links between stages)"
    if reason and not a.loopback:
        print(f"emulated network unavailable ({reason}): loopback", flush=True)
    load_before = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for pp, dp, ep in layouts:
            cfg = {
                "layout": (pp, dp, ep),
                "schedules": ep2_schedules if ep > 1 else schedules,
                "microbatches": _ints(a.microbatches),
                "blocks": a.blocks,
                "d_model": a.d_model,
                "d_ff": a.d_ff,
                "experts": a.experts,
                "top_k": a.top_k,
                "vocab": a.vocab,
                "seq": a.seq,
                "microbatch_rows": a.microbatch_rows,
                "steps": a.steps,
                "warmup": a.warmup,
                "rate_mbit": a.rate,
                "burst_kb": a.burst_kb,
                "latency_ms": a.latency_ms,
                "timeout": a.timeout,
                "wall_limit": a.wall_limit,
                "json": str(Path(tmp) / f"pipeline-{pp}-{dp}-{ep}.json"),
            }
            print(f"# pp={pp} dp={dp} ep={ep}, {network}", flush=True)
            results.append(run_loopback(cfg) if reason else run_emulated(cfg))
    meta = {k: v for k, v in vars(a).items() if k not in ("worker_config", "out")}
    meta.update(
        date=datetime.date.today().isoformat(),
        cores=os.cpu_count(),
        network=network,
        loopback_reason=reason,
        load_before=load_before,
        load_after=os.getloadavg()[0],
        command=rerun_command(sys.argv[1:] if argv is None else argv),
    )
    table = summarize(results)
    for row in table:
        print(
            f"pp={row['pp']} ep={row['ep']} {row['schedule']:>21} m={row['microbatches']}: "
            f"step {row['step_ms']:.1f} ms, bubble {row['bubble_mean']:.2f} "
            f"(theory {row['theory']:.2f})",
            flush=True,
        )
    if a.out:
        for path in write_outputs(Path(a.out), meta, results, table):
            print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
