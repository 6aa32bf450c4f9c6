"""PNG plots of a training run: loss curve, per-layer expert load over training, samples."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_loss(history: dict, path: Path) -> Path:
    """Training loss (and aux loss, drop rate) against step."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1.3))
    steps = history["step"]
    ax.plot(steps, history["loss"], lw=1, label="train loss")
    if history.get("eval_step"):
        ax.plot(history["eval_step"], history["eval_loss"], "o-", label="held-out loss")
    ax.set_yscale("log")
    ax.set_ylabel("cross-entropy / token")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot(steps, history["aux"], lw=1, color="tab:green", label="aux loss")
    ax2.set_ylabel("aux loss")
    ax2.set_xlabel("step")
    twin = ax2.twinx()
    twin.plot(steps, [100 * d for d in history["drop"]], lw=1, color="tab:red", label="dropped %")
    twin.set_ylabel("dropped %", color="tab:red")
    ax2.grid(alpha=0.3)
    fig.suptitle(history.get("title", "training"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_expert_load(history: dict, path: Path) -> Path | None:
    """One heatmap per MoE layer: experts (rows) x steps (columns), share of routed tokens;
    below them one panel per balance metric (a curve per layer): see balance_metrics.

    A uniform router gives 1/E everywhere; a dark row is an expert the router starves.
    Steps are averaged in windows (at most 100 columns).
    """
    loads = history.get("load", {})
    if not loads:
        return None
    names = list(loads)
    rows = len(names) + len(BALANCE_METRICS)
    fig, axes = plt.subplots(rows, 1, figsize=(8, 1.2 + 1.6 * rows), squeeze=False)
    steps = history["step"]
    for ax, name in zip(axes[:, 0], names):
        load_SE = _binned(np.asarray(loads[name], dtype=float), columns=100)
        E = load_SE.shape[1]
        im = ax.imshow(
            load_SE.T,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=0.0,
            vmax=max(2.0 / E, float(load_SE.max())),
            extent=(steps[0] - 0.5, steps[-1] + 0.5, E - 0.5, -0.5),
        )
        ax.set_ylabel(f"{name}\nexpert")
        fig.colorbar(im, ax=ax, label="share of tokens")
    for ax, (metric, label) in zip(axes[len(names) :, 0], BALANCE_METRICS.items()):
        for name in names:
            ax.plot(steps, balance_metrics(loads[name])[metric], lw=1, label=name)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[len(names), 0].legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("expert load per MoE layer (uniform = 1/E) and balance metrics")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


BALANCE_METRICS = {
    "cv": "load CV\n(std / mean)",
    "max_over_mean": "max / mean\nload",
    "dead": "dead experts",
}


def balance_metrics(shares_SE) -> dict[str, np.ndarray]:
    """Per step: coefficient of variation of the load, max / mean load, experts with no token
    (the step's load over all micro-batches and ranks, as layer.stats gives per forward)."""
    load_SE = np.asarray(shares_SE, dtype=float)
    mean_S = load_SE.mean(1)
    safe_S = np.where(mean_S > 0, mean_S, 1.0)
    return {
        "cv": np.where(mean_S > 0, load_SE.std(1) / safe_S, 0.0),
        "max_over_mean": np.where(mean_S > 0, load_SE.max(1) / safe_S, 0.0),
        "dead": (load_SE == 0).sum(1),
    }


def _binned(x_SE: np.ndarray, columns: int) -> np.ndarray:
    """Mean over consecutive windows of steps, so at most `columns` columns (less noise)."""
    window = max(1, -(-x_SE.shape[0] // columns))
    pad = (-x_SE.shape[0]) % window
    if pad:
        x_SE = np.concatenate([x_SE, np.repeat(x_SE[-1:], pad, axis=0)])
    return x_SE.reshape(-1, window, x_SE.shape[1]).mean(1)


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
