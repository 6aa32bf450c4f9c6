"""Plot a routing trace (moe.RoutingTrace) to PNG:

    python -m moe.trace.plot routing_trace.jsonl expert_load.png

Per MoE layer a heatmap of experts (rows) x steps (columns), the share of the layer's routed
pairs each expert got (uniform = 1/E; a dark row is an expert the router starves); then the
share of each EP rank (E experts in ep contiguous blocks; drawn when ep > 1) and the load
metrics over steps. All panels share the step axis and one colour scale (one colorbar) serves
every heatmap; EP ranks' lines differ in style and marker, so coinciding ones stay visible.
A trace of many layers draws at most MAX_LAYERS of them (evenly spread, first and last
included, named in the title), so the figure stays a few thousand pixels tall.
Needs matplotlib (the `examples` or `bench` extra): without it, a clear error says so.
"""

import sys
from pathlib import Path

import numpy as np

from moe.trace.routing_trace import read_trace

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


RANK_STYLES = [  # (line style, marker): EP ranks stay apart where their lines coincide
    ("-", None),
    ("--", "o"),
    (":", "s"),
    ("-.", "^"),
]


def shared_vmax(layers: dict[str, dict]) -> float:
    """ONE colour scale for every layer's heatmap: the largest binned share of any layer, and
    at least 2/E of the layer with the fewest experts (so uniform load sits mid-scale)."""
    return max(
        max(2.0 / d["routed"].shape[1], float(_binned(_shares(d["routed"])).max()))
        for d in layers.values()
    )


def _heatmap(ax, name: str, d: dict, vmax: float):
    steps, binned_SE = d["step"], _binned(_shares(d["routed"]))
    E = binned_SE.shape[1]
    ax.set_ylabel(f"{name}\nexpert")
    return ax.imshow(
        binned_SE.T,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        vmin=0.0,
        vmax=vmax,
        extent=(steps[0] - 0.5, steps[-1] + 0.5, E - 0.5, -0.5),
    )


def _rank_shares(ax, name: str, d: dict) -> None:
    """Each EP rank's share of the layer's pairs, one line style and marker per rank, later
    ranks drawn over earlier ones; the legend says when all ranks coincide at every step."""
    steps, rank_SW = d["step"], _shares(d["rank_load"])
    ep = rank_SW.shape[1]
    every = max(1, len(steps) // 20)  # markers on ~20 steps, not on every one
    for r in range(ep):
        ls, marker = RANK_STYLES[r % len(RANK_STYLES)]
        ax.plot(
            steps,
            rank_SW[:, r],
            ls=ls,
            marker=marker,
            markevery=every,
            ms=3,
            lw=2.2 if r == 0 else 1.2,
            zorder=2 + r,
            label=f"EP rank {r}",
        )
    ax.axhline(1 / ep, color="0.5", lw=0.8, ls=(0, (1, 3)), zorder=1, label=f"even (1/{ep})")
    equal = bool(np.allclose(rank_SW, rank_SW[:, :1]))
    ax.legend(
        fontsize=6,
        ncol=min(ep + 1, 9),
        loc="upper right",
        title="all EP ranks equal at every step: lines overlap" if equal else None,
        title_fontsize=6,
    )
    ax.set_ylabel(f"{name}\nrank share")
    ax.grid(alpha=0.3)


def figure(layers: dict[str, dict], title: str):
    """The figure of `layers` (by_layer's form, at most MAX_LAYERS): all panels share the x
    axis (steps) and one colour scale serves every heatmap (one colorbar above them all), so
    the columns line up with the panels below and colours compare across layers."""
    plt = _pyplot()
    per_layer = 2 if any(d["rank_load"].shape[1] > 1 for d in layers.values()) else 1
    rows = per_layer * len(layers) + len(METRICS)
    fig, axes = plt.subplots(
        rows, 1, figsize=(8, 1.6 + 1.6 * rows), squeeze=False, sharex=True, layout="constrained"
    )
    axes = axes[:, 0]
    vmax = shared_vmax(layers)
    for i, (name, d) in enumerate(layers.items()):
        im = _heatmap(axes[per_layer * i], name, d, vmax)
        if per_layer == 2:  # expert parallelism: each EP rank's share of the layer's pairs
            _rank_shares(axes[per_layer * i + 1], name, d)
    # one colorbar over all panels: every panel keeps the same x extent (none is narrowed)
    bar = fig.colorbar(im, ax=list(axes), location="top", shrink=0.6, aspect=40, pad=0.01)
    bar.set_label("heatmaps: share of the layer's routed (token, expert) pairs", fontsize=8)
    for ax, (metric, label) in zip(axes[per_layer * len(layers) :], METRICS.items()):
        for name, d in layers.items():
            ax.plot(d["step"], d[metric], lw=1, label=name)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if metric == "dead_experts":  # a count: whole-number ticks
            ax.yaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=6, ncol=min(len(layers), 4), loc="upper right")
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    return fig


def plot_trace(trace: str | Path, out: str | Path, title: str | None = None) -> Path:
    """Draw the trace file `trace` into the PNG `out` (exactly that path, suffix or not);
    returns `out`."""
    records = [r for r in read_trace(trace) if "kind" not in r]  # routing lines
    if not records:
        raise ValueError(f"{trace}: the trace has no lines to plot")
    plt = _pyplot()
    all_layers = by_layer(records)
    layers = shown_layers(all_layers)
    title = title or "expert load per MoE layer (uniform = 1/E), rank loads, metrics"
    if len(layers) < len(all_layers):
        title = f"{title} ({len(layers)} of {len(all_layers)} layers shown)"
    fig = figure(layers, title)
    out = Path(out)
    fig.savefig(out, dpi=110, format="png")  # no suffix: still this path, not <out>.png
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m moe.trace.plot TRACE.jsonl OUT.png", file=sys.stderr)
        return 2
    try:
        print(plot_trace(args[0], args[1]))
    except (ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
