"""transformers' own sparse-MoE blocks vs the same blocks converted by moe.from_hf: forward +
backward time (one process, round-robin interleaved, medians) and peak memory (a fresh
process per candidate, see peak_memory.py), on the CPU.

    python -m bench.hf_blocks [--tokens 2048 --iters 7]

Shapes: a Mixtral-like block (E=8, k=2, d=512, F=1792 scaled from 4096/14336) and a
Qwen3-30B-A3B-like fine-grained block (E=128, k=8, d=512, F=96 scaled from 2048/768), both
SiLU-gated experts, fp32. Writes bench/results/<date>-cpu-hf-blocks.md.
"""

import argparse
import json
import sys

import torch

import moe
from bench.common import device_name, time_interleaved, write_report
from bench.peak_memory import measure, measure_here

SHAPES = {
    "mixtral-like E=8 k=2": ("mixtral", dict(hidden_size=512, intermediate_size=1792)),
    "qwen3-30b-a3b-like E=128 k=8": ("qwen3", dict(hidden_size=512, moe_intermediate_size=96)),
}


def build_block(shape: str, impl: str):
    import transformers as T

    family, sizes = SHAPES[shape]
    torch.manual_seed(0)
    if family == "mixtral":
        cfg = T.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **sizes)
        block = T.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    else:
        cfg = T.Qwen3MoeConfig(num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, **sizes)
        block = T.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    if impl == "moe":
        holder = torch.nn.Sequential(block)
        holder.config = cfg
        block = moe.from_hf(holder)[0]
    return block.float().train()


def make_step(block, tokens: int):
    x = torch.randn(1, tokens, block_width(block), requires_grad=True)
    g = torch.randn_like(x)

    def step():
        block.zero_grad(set_to_none=True)
        x.grad = None
        block(x).backward(g)
        x.grad = None

    return step


def block_width(block) -> int:
    return (
        block.config.d_model
        if hasattr(block, "config") and hasattr(block.config, "d_model")
        else block.gate.weight.shape[1]
    )


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-probe", nargs=3, metavar=("SHAPE", "IMPL", "TOKENS"))
    args = p.parse_args(argv)
    if args.memory_probe:
        shape, impl, tokens = args.memory_probe
        block = build_block(shape, impl)
        step = make_step(block, int(tokens))
        peak = measure_here(step, lambda: block.zero_grad(set_to_none=True))
        print(json.dumps({"peak_bytes": peak}))
        return ""
    rows = []
    for shape in SHAPES:
        blocks = {impl: build_block(shape, impl) for impl in ("transformers", "moe")}
        t = time_interleaved(
            {k: make_step(b, args.tokens) for k, b in blocks.items()},
            args.iters, args.warmup, torch.device("cpu"),
        )  # fmt: skip
        mem = {k: measure("bench.hf_blocks", shape, k, str(args.tokens)) for k in blocks}
        rows.append((shape, t, mem))
        print(
            f"{shape}: transformers {t['transformers'] * 1e3:.1f} ms, moe {t['moe'] * 1e3:.1f} ms "
            f"({t['transformers'] / t['moe']:.2f}x); peak MiB {mem}",
            flush=True,
        )
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.1f}"
    table = (
        "| block | transformers fwd+bwd (ms) | moe fwd+bwd (ms) | speed-up | "
        "transformers peak (MiB) | moe peak (MiB) |\n|---|---|---|---|---|---|\n"
    ) + "".join(
        f"| {s} | {t['transformers'] * 1e3:.1f} | {t['moe'] * 1e3:.1f} | "
        f"{t['transformers'] / t['moe']:.2f}x | {mib(m['transformers'])} | {mib(m['moe'])} |\n"
        for s, t, m in rows
    )
    report = (
        "# transformers' sparse-MoE blocks vs moe.from_hf, forward+backward\n\n"
        f"- device: {device_name(torch.device('cpu'))}, torch {torch.__version__}\n"
        f"- command: `python -m bench.hf_blocks {' '.join(argv or sys.argv[1:])}`\n"
        f"- {args.tokens} tokens, fp32, SiLU-gated experts, median of {args.iters} round-robin "
        f"iterations after {args.warmup} warm-up; peak = bytes a fwd+bwd adds at its peak, "
        "measured in a fresh process per candidate (bench/peak_memory.py)\n\n" + table
    )
    print(table)
    print("report:", write_report("hf-blocks", report, torch.device("cpu")))
    return report


if __name__ == "__main__":
    main()
