"""Busbw vs message size (PNG); the only module that imports matplotlib."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.a2a.model import predict_flat, predict_hier  # noqa: E402
from bench.a2a.tables import busbw  # noqa: E402
from moe.comm.cost_model import CostModel  # noqa: E402

LINES = {"raw": "raw all_to_all_single", "flat*": "moe flat", "hier*": "moe hierarchical"}


def plot_busbw(path: Path, result: dict, title: str, model: CostModel | None) -> None:
    """One line per algorithm (token exchange, reused plan); dashed: the model's prediction."""
    meta, rows = result["meta"], result["rows"]
    W, L = meta["world_size"], meta["ranks_per_node"]
    sizes = [r["size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for algo, label in LINES.items():
        bw = [busbw(r["size"], r["time_us"][algo], W)[1] for r in rows]
        ax.plot(sizes, bw, marker="o", ms=3, label=label)
    if model is not None:
        N = W // L
        flat = [busbw(S, predict_flat(model, S, N, L) * 1e6, W)[1] for S in sizes]
        hier = [
            busbw(S, predict_hier(model, S, N, L, r["chunks"]) * 1e6, W)[1]
            for S, r in zip(sizes, rows)
        ]
        ax.plot(sizes, flat, "--", color="C1", label="model: flat")
        ax.plot(sizes, hier, "--", color="C2", label="model: hierarchical")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("busbw (GB/s, token exchange, reused plan)")
    ax.set_title(f"all-to-all busbw, {title} (gloo, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
