"""Plot a routing trace (moe.RoutingTrace) to PNG:

    python -m moe.tools.plot_trace routing_trace.jsonl expert_load.png

Per MoE layer a heatmap of experts (rows) x steps (columns), the share of the layer's routed
pairs each expert got (uniform = 1/E; a dark row is an expert the router starves); then the
share of each EP rank (E experts in ep contiguous blocks; drawn when ep > 1) and the load
metrics over steps. A trace of many layers draws at most MAX_LAYERS of them (evenly spread,
first and last included, named in the title), so the figure stays a few thousand pixels tall.
Needs matplotlib (the `examples` or `bench` extra): without it, a clear error says so.
"""

import sys
from pathlib import Path

import numpy as np

from moe.routing_trace import read_trace

METRICS = {
    "load_cv": "load CV\n(std / mean)",
    "max_over_mean": "max / mean\nload",
    "dead_experts": "dead experts",
}
MAX_LAYERS = 8  # layer panels drawn at most (a 1000-layer trace: 8 panels, not 1000)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plotting a routing trace needs matplotlib: pip install matplotlib "
            "(or the moe[examples] extra)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def by_layer(records: list[dict]) -> dict[str, dict[str, np.ndarray]]:
    """Per layer (file order): steps [S], routed [S, E], rank_load [S, ep] and each metric [S]."""
    layers: dict[str, list[dict]] = {}
    for r in records:
        layers.setdefault(r["layer"], []).append(r)
    return {
        name: {
            "step": np.array([r["step"] for r in rs]),
            "routed": np.array([r["routed_per_expert"] for r in rs], dtype=float),
            "rank_load": np.array([r["rank_load"] for r in rs], dtype=float),
            **{m: np.array([r[m] for r in rs], dtype=float) for m in METRICS},
        }
        for name, rs in layers.items()
    }


def _shares(x_SN: np.ndarray) -> np.ndarray:
    total_S1 = x_SN.sum(1, keepdims=True)
    return x_SN / np.where(total_S1 > 0, total_S1, 1.0)


def _binned(x_SE: np.ndarray, columns: int = 100) -> np.ndarray:
    """Mean over consecutive windows of steps, so at most `columns` columns (less noise)."""
    window = max(1, -(-x_SE.shape[0] // columns))
    pad = (-x_SE.shape[0]) % window
    if pad:
        x_SE = np.concatenate([x_SE, np.repeat(x_SE[-1:], pad, axis=0)])
    return x_SE.reshape(-1, window, x_SE.shape[1]).mean(1)


def shown_layers(layers: dict[str, dict]) -> dict[str, dict]:
    """At most MAX_LAYERS of the layers, evenly spread in file order (first and last kept)."""
    if len(layers) <= MAX_LAYERS:
        return layers
    names = list(layers)
    keep = np.linspace(0, len(names) - 1, MAX_LAYERS).round().astype(int)
    return {names[i]: layers[names[i]] for i in keep}


def plot_trace(trace: str | Path, out: str | Path, title: str | None = None) -> Path:
    """Draw the trace file `trace` into the PNG `out` (exactly that path, suffix or not);
    returns `out`."""
    records = [r for r in read_trace(trace) if "kind" not in r]  # routing lines
    if not records:
        raise ValueError(f"{trace}: the trace has no lines to plot")
    plt = _pyplot()
    all_layers = by_layer(records)
    layers = shown_layers(all_layers)
    if len(layers) < len(all_layers):
        title = f"{title or 'expert load'} ({len(layers)} of {len(all_layers)} layers shown)"
    per_layer = 2 if any(d["rank_load"].shape[1] > 1 for d in layers.values()) else 1
    rows = per_layer * len(layers) + len(METRICS)
    fig, axes = plt.subplots(rows, 1, figsize=(8, 1.2 + 1.6 * rows), squeeze=False)
    axes = axes[:, 0]
    for i, (name, d) in enumerate(layers.items()):
        steps, share_SE = d["step"], _shares(d["routed"])
        binned_SE = _binned(share_SE)
        E = share_SE.shape[1]
        ax = axes[per_layer * i]
        im = ax.imshow(
            binned_SE.T,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=0.0,
            vmax=max(2.0 / E, float(binned_SE.max())),
            extent=(steps[0] - 0.5, steps[-1] + 0.5, E - 0.5, -0.5),
        )
        ax.set_ylabel(f"{name}\nexpert")
        fig.colorbar(im, ax=ax, label="share of pairs")
        if per_layer == 2:  # expert parallelism: each EP rank's share of the layer's pairs
            ax, rank_SW = axes[per_layer * i + 1], _shares(d["rank_load"])
            for r in range(rank_SW.shape[1]):
                ax.plot(steps, rank_SW[:, r], lw=1, label=f"EP rank {r}")
            ax.set_ylabel(f"{name}\nrank share")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, ncol=min(rank_SW.shape[1], 8))
    for ax, (metric, label) in zip(axes[per_layer * len(layers) :], METRICS.items()):
        for name, d in layers.items():
            ax.plot(d["step"], d[metric], lw=1, label=name)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[per_layer * len(layers)].legend(fontsize=7)
    axes[-1].set_xlabel("step")
    fig.suptitle(title or "expert load per MoE layer (uniform = 1/E), rank loads, metrics")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110, format="png")  # no suffix: still this path, not <out>.png
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m moe.tools.plot_trace TRACE.jsonl OUT.png", file=sys.stderr)
        return 2
    try:
        print(plot_trace(args[0], args[1]))
    except (ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
