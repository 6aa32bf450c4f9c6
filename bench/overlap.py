"""Overlapped vs plain expert-parallel dispatch: one MoE layer's forward + backward on gloo
ranks over the emulated two-tier network of bench/a2a (network namespaces, `tc tbf` links),
at several link speeds, next to the exchange alone and the experts alone.

  python -m bench.overlap --emulate 2x2 --rates 100,200,400 --report bench/results/DATE-cpu-overlap.md

Columns: plain (the ExpertParallelDispatcher), n=2 / n=4 (OverlappedDispatcher with that many
chunks), auto (overlap="auto" with a cost model fitted on the link), exchange (the layer's four
all-to-alls: dispatch, combine and their gradients), experts (the local experts' forward +
backward on the same rows). Ideal = max(exchange, experts); hidden = (plain - t) / min(exchange,
experts), the share of the smaller part that the overlap hid. The report also splits each time
into forward + backward and gives the CPU time of all ranks per call (user + system: the
emulated network's kernel path is CPU work on the same 2 cores as the experts).

The tbf bucket (--burst-kb) defaults to 128 kB: with a bucket below the 64 kB GSO packet the
kernel segments every packet into 1500-byte frames in software, which at 2 MB per rank costs
~10 ms of CPU per rank and all-to-all (4x the 128 kB setting, measured with getrusage) and
made the exchange compete with the experts for the 2 cores at 400 Mbit/s; a NIC segments in
hardware. Needs root (ip netns, tc); about 3-5 minutes for 3 rates x 9 rounds on a quiet
2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.a2a.netem import netns_available, run_emulated
from bench.a2a.overlap_report import write_report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--emulate", default="2x2", help="NxL: nodes x ranks per node (root)")
    p.add_argument("--rates", default="100,200,400", help="link speeds, Mbit/s")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--degrees", default="2,4")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--burst-kb",
        type=int,
        default=128,
        help="tbf bucket; below the 64 kB GSO packet tbf segments every packet in software "
        "(~10 ms CPU per rank and all-to-all at 2 MB, an artefact a NIC does not have)",
    )
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--wall-limit", type=float, default=900.0)
    p.add_argument("--report", default=None)
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker_config:
        from bench.a2a.overlap_worker import worker_main

        worker_main(json.loads(a.worker_config))
        return 0
    N, L = (int(v) for v in a.emulate.lower().split("x"))
    reason = netns_available()
    if reason is not None:
        print(f"emulated network unavailable ({reason}): nothing measured", flush=True)
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rate in [int(r) for r in a.rates.split(",")]:
            cfg = {
                "emulate": (N, L),
                "ranks_per_node": L,
                "rate_mbit": rate,
                "burst_kb": a.burst_kb,
                "latency_ms": a.latency_ms,
                "tokens": a.tokens,
                "d_model": a.d_model,
                "d_ff": a.d_ff,
                "experts": a.experts,
                "top_k": a.top_k,
                "degrees": [int(n) for n in a.degrees.split(",")],
                "rounds": a.rounds,
                "warmup": a.warmup,
                "timeout": a.timeout,
                "wall_limit": a.wall_limit,
                "json": str(Path(tmp) / f"overlap-{rate}.json"),
            }
            print(f"# {N}x{L} ranks, link {rate} Mbit/s", flush=True)
            rows += run_emulated(cfg, entry="-mbench.overlap")["rows"]
    meta = {k: v for k, v in vars(a).items() if k not in ("worker_config", "report")}
    meta["date"] = datetime.date.today().isoformat()
    meta["cores"] = os.cpu_count()
    if a.report:
        write_report(Path(a.report), meta, rows)
        print(f"wrote {a.report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
