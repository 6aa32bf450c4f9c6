"""Step time of one expert-parallel MoE step on the emulated network of the overlap report
(bench/a2a/netem.py: network namespaces, `tc tbf` links at 100-400 Mbit/s), bf16 against FP8
dispatch, side by side in one run (issue 40).

One step, forward + backward, in bf16 rows: the dispatch exchange (tokens x top-k rows to their
experts' ranks), the local experts (SwiGLU, moe's torch kernel), the combine exchange home.
Variants, interleaved in rounds (median of the slowest rank's time per round):
  layer bf16 / layer fp8 dispatch: the whole moe.MoELayer (bf16, top-k router, dropless) under
                         moe.parallel.parallelize (ep = world, flat exchange), fp8=None against
                         FP8Config(dispatch=True): the library's own expert-parallel path
  bf16                   all four exchanges in bf16 (moe.comm.exchange)
  fp8 dispatch           the dispatch forward as e4m3 + 1x128 fp32 scales (moe.fp8.fp8_dispatch),
                         the other three in bf16 (FP8Config(dispatch=True), the default)
  fp8 dispatch + grad    also the gradient before the down-projection in FP8
                         (grad_before_down_fp8=True, DeepSeek-V3's)
  exchange bf16 / fp8 dispatch: the four exchanges alone (no experts) of the two above.
The rows "bf16", "fp8 dispatch", "fp8 dispatch + grad" and "exchange ..." compose
moe.fp8.fp8_dispatch / fp8_combine with the local experts by hand (no router, even load).

  python -m bench.fp8_step --emulate 2x2 --rates 100,200,400 --report bench/results/DATE-cpu-fp8-step.md

Needs root (ip netns, tc); one emulated run at a time (the namespaces have fixed names).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.a2a.netem import netns_available, run_emulated

VARIANTS = ("layer bf16", "layer fp8 dispatch", "bf16", "fp8 dispatch", "fp8 dispatch + grad",
            "exchange bf16", "exchange fp8 dispatch")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--emulate", default="2x2", help="NxL: nodes x ranks per node (root)")
    p.add_argument("--rates", default="100,200,400", help="link speeds, Mbit/s")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--burst-kb", type=int, default=128)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--wall-limit", type=float, default=600.0)
    p.add_argument("--report", default=None)
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _ops(cfg: dict, rank: int, W: int) -> dict:
    """The timed ops of this rank, each returning when its forward ended."""
    import moe
    from moe.comm.alltoall import exchange
    from moe.comm.expert_exchange import all_to_all_splits
    from moe.fp8 import FP8Config, fp8_combine, fp8_dispatch

    D, F, E, T, K = cfg["d_model"], cfg["d_ff"], cfg["experts"], cfg["tokens"], cfg["top_k"]
    L = E // W
    g = torch.Generator().manual_seed(rank)
    dest = torch.randint(0, W, (T * K,), generator=g)
    send = torch.bincount(dest, minlength=W).tolist()
    rows = torch.randn(T * K, D, generator=g).bfloat16()
    plan = all_to_all_splits(rows, send, algorithm="flat")
    torch.manual_seed(0)
    experts = moe.MoELayer(D, F, L, top_k=1, activation="swiglu", backend="torch").experts
    experts = experts.to(torch.bfloat16)
    R = plan.run(rows).shape[0]  # rows this rank receives; spread evenly over its experts
    offsets_L = torch.linspace(R / L, R, L).round().to(torch.int32)
    wire = {"bf16": None, "fp8 dispatch": FP8Config(dispatch=True),
            "fp8 dispatch + grad": FP8Config(dispatch=True, grad_before_down_fp8=True)}  # fmt: skip

    def step(config, with_experts=True):
        def op():
            x = rows.clone().requires_grad_()
            if config is None:
                h = exchange(x, plan)
            else:
                h = fp8_dispatch(x, plan, config)
            y = experts(h, offsets_L) if with_experts else h * 1.0
            out = exchange(y, plan.reverse()) if config is None else fp8_combine(
                y, plan.reverse(), config)  # fmt: skip
            forward_end = time.perf_counter()
            out.float().sum().backward()
            experts.zero_grad(set_to_none=True)
            return forward_end

        return op

    ops = {**_layer_ops(cfg, rank), **{name: step(c) for name, c in wire.items()}}
    ops["exchange bf16"] = step(None, with_experts=False)
    ops["exchange fp8 dispatch"] = step(wire["fp8 dispatch"], with_experts=False)
    return ops


def _layer_ops(cfg: dict, rank: int) -> dict:
    """The parallelized layer, bf16 against FP8 dispatch (same weights and tokens)."""
    import moe
    from moe.fp8 import FP8Config
    from moe.parallel import init_mesh, parallelize

    D, F, E, T, K = cfg["d_model"], cfg["d_ff"], cfg["experts"], cfg["tokens"], cfg["top_k"]
    mesh = init_mesh(dp=1, ep=dist.get_world_size())
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(100 + rank)).bfloat16()
    ops = {}
    for name, fp8 in (("layer bf16", None), ("layer fp8 dispatch", FP8Config(dispatch=True))):
        torch.manual_seed(0)
        layer = moe.MoELayer(D, F, E, top_k=K, capacity_factor=None, activation="swiglu",
                             aux_loss_coef=0.0, backend="torch", fp8=fp8).to(torch.bfloat16)  # fmt: skip
        model = parallelize(layer, mesh, algorithm="flat")

        def op(model=model):
            xx = x.clone().requires_grad_()
            y = model(xx)
            forward_end = time.perf_counter()
            y.float().sum().backward()
            model.zero_grad(set_to_none=True)
            return forward_end

        ops[name] = op
    return ops


def _slowest(*seconds: float) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def worker_main(cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout"]))
    W, rank = dist.get_world_size(), dist.get_rank()
    ops = _ops(cfg, rank, W)
    for op in ops.values():
        for _ in range(cfg["warmup"]):
            op()
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in ops}
    names = list(ops)
    for r in range(cfg["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            fwd_end = ops[name]()
            samples[name].append(tuple(_slowest(time.perf_counter() - start, fwd_end - start)))
    result = {
        "rate_mbit": cfg["rate_mbit"],
        "median_ms": {n: 1e3 * statistics.median(t[0] for t in s) for n, s in samples.items()},
        "median_fwd_ms": {n: 1e3 * statistics.median(t[1] for t in s) for n, s in samples.items()},
        "load": os.getloadavg()[0],
    }
    if rank == 0:
        Path(cfg["json"]).write_text(json.dumps({"meta": cfg, "rows": [result]}, indent=1))
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def write_report(path: Path, a, rows: list[dict]) -> None:
    head = "| link | " + " | ".join(VARIANTS) + " | layer fp8 / bf16 |"
    lines = [head, "|---" * (len(VARIANTS) + 2) + "|"]
    for r in rows:
        m = r["median_ms"]
        cells = " | ".join(f"{m[v]:.0f}" for v in VARIANTS)
        ratio = m["layer fp8 dispatch"] / m["layer bf16"]
        lines.append(f"| {r['rate_mbit']} Mbit/s | {cells} | {ratio:.2f} |")
    f = [r["median_fwd_ms"] for r in rows]
    fwd = [f"{r['rate_mbit']} Mbit/s: layer bf16 {m['layer bf16']:.0f}, layer fp8 dispatch "
           f"{m['layer fp8 dispatch']:.0f}" for r, m in zip(rows, f)]  # fmt: skip
    N, L = a.emulate.lower().split("x")
    text = [
        f"# Expert-parallel step time, bf16 vs FP8 dispatch, emulated network "
        f"({datetime.date.today().isoformat()}, 2-core CPU, gloo)", "",
        f"Command: `python -m bench.fp8_step --emulate {a.emulate} --rates {a.rates} --tokens "
        f"{a.tokens} --d-model {a.d_model} --d-ff {a.d_ff} --experts {a.experts} --top-k "
        f"{a.top_k} --rounds {a.rounds}` (root: network namespaces).", "",
        f"{int(N) * int(L)} gloo ranks as {N}x{L} nodes on bench/a2a/netem.py's network "
        f"(loopback inside a node, `tc tbf` veth links between nodes, burst {a.burst_kb} kB, "
        "as in the overlap report). layer = the parallelized moe.MoELayer (bf16, SwiGLU, "
        f"{a.experts} experts, top-{a.top_k}, dropless, torch kernel, ep = {int(N) * int(L)}, "
        "flat exchange), fp8=None vs FP8Config(dispatch=True). The other columns compose the "
        "step by hand: dispatch exchange -> local SwiGLU experts "
        "(torch kernel) -> combine exchange, forward + backward, rows in bf16; "
        f"{a.tokens} tokens x top-{a.top_k} rows per rank, d = {a.d_model}, uniform random "
        "destinations. Times in ms: the slowest rank per round, median of "
        f"{a.rounds} interleaved rounds. FP8 dispatch sends d + 4 * ceil(d / 128) bytes per "
        "row instead of 2 d (x0.516 at d = 256); the combine and both gradients stay bf16 "
        "(`fp8 dispatch + grad`: the gradient before the down-projection in FP8 too).", "",
        *lines, "",
        "Forward alone (ms): " + "; ".join(fwd) + ".",
        "Machine load (1-min average at the end of each rate): "
        + ", ".join(f"{r['load']:.1f}" for r in rows) + ".", "",
    ]  # fmt: skip
    path.write_text("\n".join(text))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker_config:
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
            cfg = {**{k: v for k, v in vars(a).items() if k not in ("report", "worker_config")},
                   "emulate": (N, L), "rate_mbit": rate,
                   "json": str(Path(tmp) / f"fp8-{rate}.json")}  # fmt: skip
            print(f"# {N}x{L} ranks, link {rate} Mbit/s", flush=True)
            rows += run_emulated(cfg, entry="-mbench.fp8_step")["rows"]
    if a.report:
        write_report(Path(a.report), a, rows)
        print(f"wrote {a.report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
