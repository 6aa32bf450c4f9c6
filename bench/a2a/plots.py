"""Busbw vs message size (PNG); the only module that imports matplotlib."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.a2a.model import predict_flat, predict_hier  # noqa: E402
from bench.a2a.tables import PLOTTED, TABLE_ALGOS, busbw, compares_hier  # noqa: E402
from moe.comm.cost_model import CostModel  # noqa: E402


def plot_busbw(path: Path, result: dict, title: str, model: CostModel | None) -> None:
    """The columns the console prints (tables.PLOTTED), labelled as in the tables: full
    calls solid, reused plans dashed; dotted: the cost model's prediction (reused plan)."""
    meta, rows = result["meta"], result["rows"]
    W, L = meta["world_size"], meta["ranks_per_node"]
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110)
    for i, algo in enumerate(PLOTTED):
        if algo.startswith("hier") and not compares_hier(W, L):
            continue  # one node: the same exchange as flat
        bw = [busbw(r["size"], r["time_us"][algo], W)[1] for r in rows]
        style = "--" if algo.endswith("*") else "-"
        ax.plot(sizes, bw, style, marker="o", ms=3, color=f"C{i}",
                label=f"{algo}: {TABLE_ALGOS[algo]}")  # fmt: skip
    if model is not None:
        N = W // L
        flat = [busbw(S, predict_flat(model, S, N, L) * 1e6, W)[1] for S in sizes]
        hier = [
            busbw(S, predict_hier(model, S, N, L, r["chunks"]) * 1e6, W)[1]
            for S, r in zip(sizes, rows)
        ]
        ax.plot(sizes, flat, ":", color="C3", label="cost model: flat, reused plan")
        ax.plot(sizes, hier, ":", color="C4", label="cost model: hierarchical, reused plan")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    note = "" if compares_hier(W, L) else "; 1 node: no hierarchical lines"
    ax.set_title(f"all-to-all busbw, {title}: {W} ranks as {W // L}x{L} (gloo, CPU){note}",
                 fontsize=9)  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
