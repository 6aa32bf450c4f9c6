"""Skewed router on gloo ranks: the busiest rank's expert work per step without re-placement,
with whole-expert placement, and with placement + replicas (one spare slot per rank).

    torchrun --nproc-per-node 4 -m bench.replicas_skew [--steps 6] [--hot 0.4]

One MoE layer (E = 8, top-2, dropless) whose router sends about --hot of the pairs to expert 0.
Each configuration trains the experts (the router stays as skewed) 2 steps, calls rebalance_experts (not for "none"), then measures
--steps steps: per rank the rows its experts computed and the wall time of its experts'
forward (pre/post hooks; backward is not timed separately), and the step time (barrier to
barrier, including sum_replica_grads for replicas). CPU timings on a shared machine are noisy;
rows are exact.
"""

import argparse
import time

import torch
import torch.distributed as dist

import moe
from moe.parallel import init_mesh, parallelize, rebalance_experts, sum_replica_grads

D, F, E = 256, 1024, 8


def build(spare: int, hot_scale: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        moe.MoELayer(D, F, E, top_k=2, aux_loss_coef=0.0, spare_slots=spare)
    )
    with torch.no_grad():
        model[0].router.weight[0] += hot_scale * torch.ones(D) / D**0.5
    return model


def batch(step: int, rank: int, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(tokens, D, generator=g) + 0.5


def hot_share(hot_scale: float, tokens: int) -> float:
    model = build(0, hot_scale)
    with torch.no_grad():
        model(batch(0, 0, tokens))
    counts = model[0].stats["tokens_per_expert"].float()
    return float(counts[0] / counts.sum())


def run(name: str, spare: int, rebalance: bool, args, hot_scale: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = parallelize(build(spare, hot_scale), init_mesh(dp=1, ep=world), "ddp")
    layer = model[0]
    opt = torch.optim.AdamW(layer.experts.parameters(), lr=1e-3)  # the router keeps its skew
    rows, expert_s = [0], [0.0]
    start = [0.0]

    def pre(module, inputs):
        start[0] = time.perf_counter()
        x = inputs[0]
        rows[0] += x.shape[0] if isinstance(x, torch.Tensor) else 0

    def post(module, inputs, output):
        expert_s[0] += time.perf_counter() - start[0]

    def step(s: int) -> None:
        model(batch(s, rank, args.tokens)).square().mean().backward()
        if spare:
            sum_replica_grads(model)
        opt.step()
        opt.zero_grad()

    for s in range(2):
        step(s)
    if rebalance:
        rebalance_experts(model, opt, min_gain=0.0)
    hooks = [
        layer.experts.register_forward_pre_hook(pre),
        layer.experts.register_forward_hook(post),
    ]
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(2, 2 + args.steps):
        step(s)
    dist.barrier()
    step_s = (time.perf_counter() - t0) / args.steps
    for h in hooks:
        h.remove()
    mine = torch.tensor([rows[0] / args.steps, expert_s[0] / args.steps * 1e3])
    everyone = [torch.zeros(2, dtype=mine.dtype) for _ in range(world)]
    dist.all_gather(everyone, mine)
    per_rank = torch.stack(everyone)
    return {
        "name": name,
        "rows": per_rank[:, 0].tolist(),
        "ms": per_rank[:, 1].tolist(),
        "step": step_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    ap.add_argument("--hot", type=float, default=0.4, help="share of pairs to expert 0")
    args = ap.parse_args()
    if not 0 < args.hot < 0.5 or args.steps < 1 or args.tokens < 1:
        ap.error("--hot must be in (0, 0.5) (top-2), --steps and --tokens >= 1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    lo, hi = 0.0, 64.0  # the router scale that gives expert 0 the --hot share (host search)
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if hot_share(mid, args.tokens) < args.hot else (lo, mid)
    scale = (lo + hi) / 2
    results = [
        run("none", 0, False, args, scale),
        run("placement", 0, True, args, scale),
        run(f"placement + {world} replicas", world, True, args, scale),
    ]
    if dist.get_rank() == 0:
        share = hot_share(scale, args.tokens)
        print(
            f"{world} gloo ranks, E={E}, top-2, d={D}, F={F}, {args.tokens} tokens/rank/step, "
            f"expert 0 takes {share:.2f} of the pairs; {args.steps} measured steps"
        )
        print(
            "| configuration | rows per rank | busiest/mean rows | busiest rank expert fwd ms | "
            "step ms |\n|---|---|---|---|---|"
        )
        for r in results:
            mean = sum(r["rows"]) / len(r["rows"])
            busiest = max(range(world), key=r["rows"].__getitem__)
            print(
                f"| {r['name']} | {[round(x) for x in r['rows']]} | {max(r['rows']) / mean:.2f} | "
                f"{r['ms'][busiest]:.1f} | {r['step'] * 1e3:.1f} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
