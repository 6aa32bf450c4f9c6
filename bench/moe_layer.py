"""MoELayer forward+backward time against a dense FFN of the same active FLOPs (d_ff * k).

    python bench/moe_layer.py [--tokens 4096 --d-model 512 --d-ff 1024 --iters 10]

Prints a table with the MoE/dense ratio and writes a dated report to bench/results/.
"""

import argparse
import sys

import torch
from torch import nn

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import device_name, time_interleaved, write_report  # noqa: E402

import moe  # noqa: E402


def dense_ffn(d_model: int, d_ff: int, device) -> nn.Module:
    return nn.Sequential(
        nn.Linear(d_model, d_ff, bias=False), nn.GELU(), nn.Linear(d_ff, d_model, bias=False)
    ).to(device)


def step(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    def run():
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = module(x)
        y.backward(g)

    return run


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--cases",
        default="8:2:none,8:1:none,8:2:1.25,8:1:1.25,64:2:none,64:1:none,64:2:1.25,64:1:1.25",
        help="E:k:capacity_factor list",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    T, D, F = args.tokens, args.d_model, args.d_ff
    x = torch.randn(T, D, device=device, requires_grad=True)
    g = torch.randn(T, D, device=device)
    rows = []
    for case in args.cases.split(","):
        E, k, cf = case.split(":")
        E, k, cf = int(E), int(k), None if cf == "none" else float(cf)
        layer = moe.MoELayer(D, F, E, top_k=k, capacity_factor=cf).to(device)
        dense = dense_ffn(D, F * k, device)
        t = time_interleaved(
            {"moe": step(layer, x, g), "dense": step(dense, x, g)}, args.iters, args.warmup, device
        )
        dropped = float(layer.stats["dropped_fraction"])
        rows.append(
            (
                E,
                k,
                "dropless" if cf is None else cf,
                t["moe"] * 1e3,
                t["dense"] * 1e3,
                t["moe"] / t["dense"],
                dropped,
            )
        )
        print(
            f"E={E:3d} k={k} cf={rows[-1][2]!s:8} moe {rows[-1][3]:8.2f} ms  dense "
            f"{rows[-1][4]:8.2f} ms  ratio {rows[-1][5]:.3f}  dropped {dropped:.3f}",
            flush=True,
        )
    header = (
        "| E | k | capacity | MoE fwd+bwd (ms) | dense FFN d_ff*k (ms) | MoE/dense | dropped |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    table = header + "".join(
        f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.3f} | {r[6]:.3f} |\n"
        for r in rows
    )
    report = (
        f"# MoELayer vs dense FFN, forward+backward\n\n"
        f"- device: {device_name(device)}\n- torch {torch.__version__}\n"
        f"- command: `python bench/moe_layer.py {' '.join(argv or sys.argv[1:])}`\n"
        f"- T={T}, d_model={D}, d_ff={F}, gelu, fp32, median of {args.iters} interleaved "
        f"iterations after {args.warmup} warm-up\n\n{table}"
    )
    print(table)
    print("report:", write_report("moe-layer", report, device))
    return report


if __name__ == "__main__":
    main()
