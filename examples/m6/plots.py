"""PNG plots of a training run: loss curve, per-layer expert load (from the routing trace, one
file per (dp, ep) layout), samples."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def _wrap(title: str, width: int = 95) -> str:
    """A title's lines wrapped to the figure's width (the settings line is long)."""
    return "\n".join(textwrap.fill(line, width) for line in title.splitlines())


def plot_loss(history: dict, path: Path) -> Path:
    """Training loss (and aux loss, drop rate) against step."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1.3))
    steps = history["step"]
    ax.plot(steps, history["loss"], lw=1, label="train loss")
    if history.get("eval_step"):
        ax.plot(history["eval_step"], history["eval_loss"], "o-", label="held-out loss")
    ax.set_yscale("log")
    ax.set_ylabel("cross-entropy / token")
    ax.grid(alpha=0.3)
    ax2.plot(steps, history["aux"], lw=1, color="tab:green", label="aux (balance) loss")
    ax2.set_ylabel("aux loss", color="tab:green")
    ax2.set_xlabel("step")
    twin = ax2.twinx()
    drops = [100 * d for d in history["drop"]]
    twin.plot(steps, drops, lw=1, color="tab:red", label="dropped (token, expert) pairs, %")
    twin.set_ylabel("dropped %", color="tab:red")
    ax2.grid(alpha=0.3)
    for resumed in history.get("resume_step", []):  # where a --resume continued the run
        for a in (ax, ax2):
            a.axvline(resumed, color="0.4", ls="--", lw=1, label=f"resumed at step {resumed}")
    ax.legend(loc="upper right", fontsize=8)
    lines = ax2.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax2.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=7)
    fig.suptitle(_wrap(history.get("title", "training")), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_expert_load(files: list, path: Path, title: str) -> Path | None:
    """The run's routing trace (examples/m6/trace_io.trace_files: one file per EP layout,
    moe.trace.segments, and a --pp run's stage files, each with its own layers; in any order:
    the lines are drawn in step order, one layout per run of steps at one EP size) drawn with
    moe.trace.plot's panels: per MoE layer a heatmap of canonical experts x steps (share of
    routed pairs: the same E in every layout, so one heatmap spans them all), each EP rank's share of the layer's pairs (each layout's own ranks over its own
    steps), the load metrics; a dashed line where the layout changed and a dotted red line at
    each expert rebalance (moe.parallel.rebalance_experts), named in the legend."""
    import numpy as np

    from moe.trace import plot as tp
    from moe.trace.routing_trace import read_trace

    lines = [r for f in files for r in read_trace(f)]
    routing: list[list[dict]] = []  # runs of steps at one EP size, in step order
    for r in sorted((r for r in lines if "kind" not in r), key=lambda r: r["step"]):
        if not routing or r["ep"] != routing[-1][-1]["ep"]:
            routing.append([])
        routing[-1].append(r)
    if not routing:
        return None
    rebalances = sorted({r["step"]: r for r in lines if "kind" in r}.values(),
                        key=lambda r: r["step"])  # fmt: skip
    pieces = [tp.by_layer(part) for part in routing]  # one layout each
    names = list(dict.fromkeys(n for piece in pieces for n in piece))
    layers = {}
    for name in names:
        segs = [piece[name] for piece in pieces if name in piece]
        layers[name] = {
            "step": np.concatenate([d["step"] for d in segs]),
            "routed": np.concatenate([d["routed"] for d in segs]),
            "segments": segs,
            **{m: np.concatenate([d[m] for d in segs]) for m in tp.METRICS},
        }
    shown = tp.shown_layers(layers)
    ranks = any(d["rank_load"].shape[1] > 1 for v in shown.values() for d in v["segments"])
    per_layer = 2 if ranks else 1
    rows = per_layer * len(shown) + len(tp.METRICS)
    fig, axes = plt.subplots(
        rows, 1, figsize=(8, 1.6 + 1.6 * rows), squeeze=False, sharex=True, layout="constrained"
    )
    axes = axes[:, 0]
    vmax = tp.shared_vmax(shown)
    panels = {}  # layer -> its rank-share panel
    for i, (name, d) in enumerate(shown.items()):
        im = tp._heatmap(axes[per_layer * i], name, d, vmax)
        if ranks:
            panels[name] = axes[per_layer * i + 1]
            _rank_shares(panels[name], name, d["segments"])
    bar = fig.colorbar(im, ax=list(axes), location="top", shrink=0.6, aspect=40, pad=0.01)
    bar.set_label("heatmaps: share of the layer's routed (token, expert) pairs", fontsize=8)
    for ax, (metric, label) in zip(axes[per_layer * len(shown) :], tp.METRICS.items()):
        for name, d in shown.items():
            ax.plot(d["step"], d[metric], lw=1, label=name)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if metric == "dead_experts":
            ax.yaxis.get_major_locator().set_params(integer=True)
    _markers(axes, pieces, rebalances, panels)
    for ax in panels.values():
        ax.legend(fontsize=6, ncol=4, loc="upper right")
    for ax in axes[per_layer * len(shown) :]:
        ax.legend(fontsize=6, ncol=min(len(shown) + 2, 4), loc="upper right")
    axes[-1].set_xlabel("step")
    if len(shown) < len(layers):
        title = f"{title} ({len(shown)} of {len(layers)} layers shown)"
    fig.suptitle(_wrap(title), fontsize=9)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def _rank_shares(ax, name: str, segments: list[dict]) -> None:
    """Each EP rank's share of the layer's routed pairs, per layout segment (rank r keeps its
    line style in every segment); a dotted line at the even share 1/ep of each segment."""
    from moe.trace import plot as tp

    labelled = set()
    for d in segments:
        steps, rank_SW = d["step"], tp._shares(d["rank_load"])
        ep = rank_SW.shape[1]
        every = max(1, len(steps) // 20)
        for r in range(ep):
            ls, marker = tp.RANK_STYLES[r % len(tp.RANK_STYLES)]
            label = f"EP rank {r}" if f"rank {r}" not in labelled else None
            labelled.add(f"rank {r}")
            ax.plot(steps, rank_SW[:, r], ls=ls, marker=marker, markevery=every, ms=3,
                    lw=2.2 if r == 0 else 1.2, zorder=2 + r, label=label)  # fmt: skip
        label = f"even (1/{ep})" if f"even {ep}" not in labelled else None
        labelled.add(f"even {ep}")
        ax.hlines(1 / ep, steps[0], steps[-1], color="0.5", lw=0.8, ls=(0, (1, 3)), label=label)
    ax.set_ylabel(f"{name}\nrank share")
    ax.grid(alpha=0.3)


def _markers(axes, pieces: list[dict], rebalances: list[dict], panels: dict) -> None:
    """Vertical lines on every panel: a dashed one where the (dp, ep) layout changed, a dotted
    red one after each expert rebalance; on each layer's rank-share panel the rebalance
    record's largest / mean rank load before -> after (of the loads the plan used: the pairs
    each expert computed since the previous rebalance). One legend entry each."""
    first = [next(iter(p.values())) for p in pieces]
    for before, after in zip(first, first[1:]):
        ep0, ep1 = before["rank_load"].shape[1], after["rank_load"].shape[1]
        at = after["step"][0] - 0.5
        for j, ax in enumerate(axes):
            ax.axvline(at, color="0.2", ls="--", lw=1,
                       label=f"resumed at ep={ep1} (was {ep0})" if j else None)  # fmt: skip
    steps = sorted({r["step"] for r in rebalances})
    for k, step in enumerate(steps):
        for ax in axes:
            label = "expert rebalance (after the step; red numbers: the plan's max/mean rank load)"
            label = label if k == 0 else None
            ax.axvline(step + 0.5, color="tab:red", ls=":", lw=1.2, label=label)
    for rec in rebalances:
        ax = panels.get(rec["layer"])
        if ax is not None:
            ax.annotate(
                f"{rec['max_over_mean_before']:.2f}->{rec['max_over_mean_after']:.2f}",
                (rec["step"] + 0.5, 0.03), xycoords=("data", "axes fraction"), fontsize=6,
                color="tab:red", ha="left", va="bottom", rotation=90,
            )  # fmt: skip


def plot_samples(images_NCHW, titles: list[str], path: Path) -> Path:
    """A grid of held-out images with their generated captions."""
    n = len(titles)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, img, title in zip(axes.flat, images_NCHW, titles):
        arr = (img.float().permute(1, 2, 0).numpy() + 1) / 2
        ax.imshow(arr.squeeze(-1) if arr.shape[-1] == 1 else arr.clip(0, 1), cmap="gray_r")
        ax.set_title(title, fontsize=7, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
