"""Bytes on the wire of one MoE layer's four exchanges, bf16 vs FP8 dispatch, COUNTED at the
collective (a spy around torch.distributed.all_to_all_single adds up the bytes each call hands
over for other ranks), not computed from a formula.

Two gloo ranks on loopback; every routed row goes to the other rank, so every row crosses the
wire. One layer = dispatch forward, combine forward, combine backward (the activation gradient
before the experts' down-projection) and dispatch backward (gradients going home), run through
moe.fp8.fp8_dispatch / fp8_combine with a real backward. Rows: tokens x top-k.

  python -m bench.fp8_wire                    # d = 2048, 4096, 7168; writes the dated report
  python -m bench.fp8_wire --no-report
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import write_report
from moe.comm.expert_exchange import all_to_all_splits
from moe.fp8 import FP8Config, fp8_combine, fp8_dispatch

VARIANTS = {
    "bf16": None,  # rows in bf16 both ways (an FP8Config with nothing on is refused)
    "fp8 dispatch (fp32 scales)": FP8Config(dispatch=True),
    "fp8 dispatch (ue8m0 scales)": FP8Config(dispatch=True, scale_format="ue8m0"),
    "fp8 dispatch + fp8 grad before down": FP8Config(dispatch=True, grad_before_down_fp8=True),
}


class _Spy:
    """Counts the bytes every all_to_all_single call sends to other ranks."""

    def __init__(self, rank: int):
        self.rank, self.sent, self.inner = rank, 0, dist.all_to_all_single

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        world = dist.get_world_size()
        rows = input_split_sizes or [input.shape[0] // world] * world
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        self.sent += sum(n for i, n in enumerate(rows) if i != self.rank) * row_bytes
        return self.inner(output, input, output_split_sizes, input_split_sizes, *a, **k)


def _layer_bytes(rank: int, d: int, rows: int, config: FP8Config | None) -> tuple[int, int]:
    """(dispatch-forward bytes, bytes of all four exchanges) sent by this rank."""
    counts = [0, rows] if rank == 0 else [rows, 0]
    x = torch.randn(rows, d, dtype=torch.bfloat16, requires_grad=True)
    plan = all_to_all_splits(x, counts)  # the count exchange happens here, before the spy
    spy = _Spy(rank)
    dist.all_to_all_single = spy
    try:
        y = fp8_dispatch(x, plan, config)
        first = spy.sent
        z = fp8_combine(y * 2, plan.reverse(), config)  # stand-in experts: any op of the rows
        z.backward(torch.randn_like(z))
    finally:
        dist.all_to_all_single = spy.inner
    return first, spy.sent


def _worker(rank: int, port: int, dims: list[int], rows: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        got = {(d, n): _layer_bytes(rank, d, rows, c) for d in dims for n, c in VARIANTS.items()}
        if rank == 0:
            out.update(got)
    finally:
        dist.destroy_process_group()


def measure(dims: list[int], rows: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(port, dims, rows, out), nprocs=2)
        return dict(out)


def table(got: dict, dims: list[int], rows: int, tokens: int) -> str:
    head = (
        "| d | variant | dispatch B/row | x bf16 | layer B/token (4 exchanges) | x bf16 |\n"
        "|---:|---|---:|---:|---:|---:|\n"
    )
    lines = []
    for d in dims:
        base_first, base_all = got[d, "bf16"]
        for name in VARIANTS:
            first, total = got[d, name]
            lines.append(
                f"| {d} | {name} | {first / rows:,.0f} | {first / base_first:.3f} | "
                f"{total / tokens:,.0f} | {total / base_all:.3f} |"
            )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[2048, 4096, 7168])
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--no-report", action="store_true")
    a = p.parse_args()
    rows = a.tokens * a.top_k
    got = measure(a.dims, rows)
    text = table(got, a.dims, rows, a.tokens)
    print(text)
    if not a.no_report:
        print("wrote", write_report("fp8-wire-bytes", _report(text, a), torch.device("cpu")))


def _report(text: str, a) -> str:
    return (
        "# FP8 dispatch: bytes on the wire per token and per layer (CPU, gloo, counted)\n\n"
        f"Command: `python -m bench.fp8_wire` ({a.tokens} tokens per rank, top-k {a.top_k}, "
        "2 gloo ranks, every row sent to the other rank). Bytes are counted by a spy around "
        "`torch.distributed.all_to_all_single` (what each call hands over for other ranks), "
        "not computed. A row is one (token, expert) pair; 'layer' = dispatch forward + "
        "combine forward + combine backward (gradient before the down-projection) + dispatch "
        "backward, per token of the rank (top-k rows each). FP8 rows: d bytes of e4m3 + one "
        "scale per 1 x 128 block (4 bytes fp32, or 1 byte UE8M0). Byte counts do not depend "
        "on the machine; no timing is reported here.\n\n" + text
    )


if __name__ == "__main__":
    main()
