"""What a person reads: the top layouts as a table (with the code that applies each) and a
plot of their predicted step-time breakdown (stacked bars) and peak memory against the
device's."""

from __future__ import annotations

from moe.plan.predict import TIME_TERMS, Prediction

GiB = 2**30


def figures_line(cluster, path: str | None) -> str:
    """One line saying whose device figures a plan used: a measured cluster file (`path`,
    python -m moe.plan profile) or a datasheet preset, which is not this machine."""
    if path:
        return f"device figures: {path} ({cluster.source})"
    return (
        f"device figures: {cluster.name}, {cluster.source}, not this machine's (measure it: "
        "python -m moe.plan profile --out cluster.json, then --cluster cluster.json)"
    )


def table(preds: list[Prediction]) -> str:
    """A markdown table: layout, step time and its terms, tokens/s per device, MFU, memory."""
    head = ["#", "layout", "step s", *TIME_TERMS, "tok/s/dev", "MFU", "peak GiB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, p in enumerate(preds, 1):
        cells = [str(i), p.layout.short(), f"{p.step_time:.3g}"]
        cells += [f"{p.time[k]:.3g}" for k in TIME_TERMS]
        cells += [f"{p.tokens_per_s_per_device:,.0f}", f"{p.mfu:.1%}", f"{p.peak_memory / GiB:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


RESIDENT = ("parameters", "gradients", "optimizer")  # held through the step
PHASES = (  # never live at once (moe.plan.predict.peak_of): side by side, the taller the peak
    ("forward / backward", ("activations", "comms"), -0.2),
    ("optimizer step", ("temporaries",), 0.2),
)


def _memory_bars(ax, preds: list[Prediction]) -> None:
    """Each layout's memory as the table counts it: the resident terms stacked, and on them
    the two phases that are never live at once side by side, so the taller one's top is the
    peak (not their sum)."""
    x = list(range(len(preds)))
    base = [0.0] * len(preds)
    for term in RESIDENT:
        vals = [p.memory[term] / GiB for p in preds]
        ax.bar(x, vals, 0.8, bottom=base, label=term)
        base = [b + v for b, v in zip(base, vals)]
    for phase, terms, shift in PHASES:
        bottom = list(base)
        for term in terms:
            vals = [p.memory[term] / GiB for p in preds]
            ax.bar([i + shift for i in x], vals, 0.4, bottom=bottom, label=f"{term} ({phase})")
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(x, [str(i) for i in range(1, len(preds) + 1)])


def plot(preds: list[Prediction], path, title: str = "") -> None:
    """Stacked bars of each layout's predicted step time by term, and its peak memory by
    category against the device limit: the resident terms, then the forward / backward and the
    optimizer step's memory side by side (never live at once; the taller top is the table's
    peak). A PNG at `path`; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{i}" for i in range(1, len(preds) + 1)]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(preds)
    for term in TIME_TERMS:
        vals = [p.time[term] for p in preds]
        ax_t.bar(labels, vals, bottom=bottom, label=term)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_t.set_ylabel("predicted step time (s)")
    ax_t.set_xlabel("layout (rank in the table)")
    ax_t.legend(fontsize=7)
    _memory_bars(ax_m, preds)
    if preds:
        ax_m.axhline(preds[0].device_memory / GiB, color="k", ls="--", label="device memory")
    ax_m.set_ylabel("predicted peak memory per device (GiB)")
    ax_m.set_xlabel("layout (rank in the table)")
    ax_m.legend(fontsize=7)
    fig.suptitle(title or "moe.plan: top layouts (predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
