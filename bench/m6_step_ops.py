"""Operators and FLOPs per M6 training step, per preset: the arithmetic behind the GPU
projection in bench/results/*-m6-gpu-projection.md (no GPU needed).

A small model in eager PyTorch on a GPU is host-bound: each operator costs host time (Python,
dispatch, a kernel launch) whatever its size, so a step's time is about (operators per step) x
(host time per operator) while the GPU keeps up. This script counts the aten operators one
step dispatches (an upper bound on its kernel launches) and its model FLOPs, for each preset.

    python -m bench.m6_step_ops   # prints the table, writes bench/results/<date>-cpu-m6-step-ops.md
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import write_report
from examples.m6 import data as m6data
from examples.m6 import train
from examples.m6.cli import parse_args, resolve_config
from examples.m6.runtime import Runtime
from examples.m6.setup import make_optimizer

PRESETS = ("m6-tiny", "m6-tiny-gpu")


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(name: str, steps: int = 3) -> dict:
    args = parse_args(["--config", name])
    cfg = resolve_config(args)
    data, cfg = train.load_data(args, cfg)
    enc = m6data.encode(data.train, data.vocab, cfg.text_len)
    torch.manual_seed(0)
    model = cfg.build()
    opt = make_optimizer(model, args)
    rt = Runtime()
    train.train_step(model, opt, data, enc, 0, args, rt)  # warm-up: optimizer state
    with CountOps() as counter:
        train.train_step(model, opt, data, enc, 1, args, rt)
    start = time.perf_counter()
    for step in range(2, 2 + steps):
        train.train_step(model, opt, data, enc, step, args, rt)
    seconds = (time.perf_counter() - start) / steps
    tokens = args.global_batch * cfg.seq_len
    attn = 4 * cfg.n_layers * cfg.seq_len * cfg.d_model  # QK^T and AV, fwd, per token
    flops = tokens * (6 * cfg.active_params + 3 * attn)
    return {"name": name, "batch": args.global_batch, "tokens": tokens, "ops": counter.ops,
            "gflop": flops / 1e9, "cpu_s": seconds, "active": cfg.active_params}  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    rows = [measure(name) for name in PRESETS]
    lines = [
        "# M6 step: operators and FLOPs per preset",
        "",
        "`python -m bench.m6_step_ops` (one CPU thread; aten ops of one training "
        "step, forward + backward + AdamW; FLOPs: 6 x active params + attention, per token).",
        "",
        "| preset | global batch | tokens/step | active params | aten ops/step | GFLOP/step | "
        "CPU s/step | CPU tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['batch']} | {r['tokens']:,} | {r['active']:,} | {r['ops']:,} | "
            f"{r['gflop']:.1f} | {r['cpu_s']:.3f} | {r['tokens'] / r['cpu_s']:,.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    print("report:", write_report("m6-step-ops", text, torch.device("cpu")))


if __name__ == "__main__":
    main()
