"""All-to-all benchmark: raw all_to_all_single vs moe flat vs moe hierarchical, side by side.

nccl-tests alltoall_perf columns: size = bytes of one rank's whole send buffer, count = elements
per peer, time (us), algbw = size / time (GB/s), busbw = algbw * (n - 1) / n. Even splits: time
averaged over ranks; uneven splits (--uneven): size = the largest per-rank buffer, time = the
maximum over ranks. Each (size, algorithm) gets 1 warm-up and up to --iters timed iterations,
split into rounds interleaved across algorithms; a rank's time is the median round mean.

  python -m bench.alltoall                        # spawns 8 gloo ranks on loopback, 2D as 2x4
  torchrun --nproc-per-node 8 -m bench.alltoall   # under torchrun (NCCL when CUDA is present)
  python -m bench.alltoall --emulate 2x4          # two-tier network in network namespaces (root)
  python -m bench.alltoall --suite --report bench/results/DATE-cpu-alltoall.md   # the report
  python -m bench.alltoall --model-only           # alpha-beta projection only

Columns "flat" and "hier" time the full moe.dispatch.all_to_all call (validation, count
exchange, token exchange); "flat*" and "hier*" time moe.dispatch.exchange with a precomputed
plan, i.e. the token exchange alone (what the reverse exchanges of an MoE layer cost).

Emulated two-tier network (--emulate NxL): each node is a network namespace moe-nK with one
veth (10.77.0.K+1/24) into a bridge living in namespace moe-sw; both directions of every veth
carry a `tc tbf` rate limit (node NIC), so inter-node traffic is shaped while ranks of one node
talk over the namespace's loopback. Gloo binds to the node's veth (GLOO_SOCKET_IFNAME); rank
0's namespace hosts the store. tbf adds no propagation delay (netem is unavailable here).

Pieces in bench/a2a/: runner.py (sweep in every rank, local launcher), netem.py (namespaces),
model.py (fit of moe.comm.cost_model to a run, projection), tables.py (nccl-tests tables,
console lines), report.py (markdown + JSON + cost profile), plots.py (PNG, matplotlib).
The report's tables are also printed on the console; tqdm only on a terminal, piped output
gets one line per finished size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from bench.a2a.model import GPU_CLUSTER
from bench.a2a.netem import netns_available, run_emulated
from bench.a2a.report import projection_table, write_report
from bench.a2a.runner import default_ranks_per_node, run_local, sweep_sizes, worker_main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=8, help="ranks to spawn when not under torchrun")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="2D layout for the hierarchical path (default: LOCAL_WORLD_SIZE across nodes; "
        "all ranks on one host: 2 emulated nodes of W/2 ranks when W is even and >= 4)",
    )
    p.add_argument(
        "--min-bytes", type=int, default=1 << 10, help="smallest per-rank send buffer (bytes)"
    )
    p.add_argument(
        "--max-bytes", type=int, default=1 << 26, help="largest per-rank send buffer (bytes)"
    )
    p.add_argument(
        "--factor", type=int, default=2, help="size step: each size is the previous times this"
    )
    p.add_argument(
        "--iters", type=int, default=20, help="timed iterations per size and algorithm (at most)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds the iterations are split into, interleaved across algorithms",
    )
    p.add_argument("--budget", type=float, default=4.0, help="target seconds per size")
    p.add_argument("--emulated-budget", type=float, default=20.0, help="same, emulated runs")
    p.add_argument(
        "--uneven",
        action="store_true",
        help="random uneven splits (size = the largest per-rank buffer)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the uneven splits")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout (s)")
    p.add_argument(
        "--wall-limit", type=float, default=1800.0, help="seconds before a run is stopped"
    )
    p.add_argument("--backend", default=None, help="force gloo under torchrun with CUDA")
    p.add_argument("--emulate", default=None, help="NxL: emulated two-tier network (root)")
    p.add_argument(
        "--rate-mbit",
        type=int,
        default=1000,
        help="emulated node link rate (tbf), Mbit/s per direction",
    )
    p.add_argument("--burst-kb", type=int, default=32, help="tbf burst (KiB)")
    p.add_argument(
        "--latency-ms",
        type=float,
        default=50.0,
        help="tbf queue bound (ms; not a propagation delay)",
    )
    p.add_argument(
        "--emulated-max-bytes", type=int, default=1 << 26, help="largest size in emulated runs"
    )
    p.add_argument(
        "--suite",
        action="store_true",
        help="loopback even+uneven and emulated 2x4 even+uneven, then the model",
    )
    p.add_argument("--report", default=None, help="write a markdown report here")
    p.add_argument(
        "--json", default=None, help="also write the rows of a run (rank 0) to this JSON file"
    )
    p.add_argument(
        "--model-only",
        action="store_true",
        help="print the alpha-beta projection for 8x8 GPUs and exit",
    )
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
        print(projection_table(GPU_CLUSTER, 8, 8, sweep_sizes(1 << 10, 1 << 26, 4)))
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        worker_main(base_cfg(a))
        return 0
    _with_signals_as_exit()
    runs: list[tuple[str, dict]] = []
    cfg = base_cfg(a)
    cfg["ranks_per_node"] = a.ranks_per_node or default_ranks_per_node(a.nproc)
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
        command = "python -m bench.alltoall " + " ".join(sys.argv[1:] if argv is None else argv)
        saved = {"results": results, "cfgs": cfgs, "argv": command}
        Path(a.report).with_suffix(".json").write_text(json.dumps(saved, indent=1))
        write_report(Path(a.report), results, cfgs, command)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
