"""PNG plots of a training run: loss curve, per-layer expert load (from the routing trace),
samples."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


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
    fig.suptitle(history.get("title", "training"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_expert_load(trace: Path, path: Path) -> Path | None:
    """The run's routing trace (moe.RoutingTrace) drawn by moe.trace.plot: per MoE layer
    a heatmap of experts x steps (share of routed pairs), rank loads, balance metrics."""
    from moe.trace.plot import plot_trace

    if not trace.exists() or not trace.read_text().strip():
        return None
    return plot_trace(trace, path, title="expert load per MoE layer (uniform = 1/E)")


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
