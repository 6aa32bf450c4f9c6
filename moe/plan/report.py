"""What a person reads: the top layouts as a table (with the code that applies each) and a
plot of their predicted step-time breakdown (stacked bars) and peak memory against the
device's."""

from __future__ import annotations

from moe.plan.predict import MEMORY_TERMS, TIME_TERMS, Prediction

GiB = 2**30


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


def plot(preds: list[Prediction], path, title: str = "") -> None:
    """Stacked bars of each layout's predicted step time by term, and its peak memory by
    category against the device limit (a PNG at `path`; needs matplotlib)."""
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
    bottom = [0.0] * len(preds)
    for term in MEMORY_TERMS:
        vals = [p.memory[term] / GiB for p in preds]
        ax_m.bar(labels, vals, bottom=bottom, label=term)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if preds:
        ax_m.axhline(preds[0].device_memory / GiB, color="k", ls="--", label="device memory")
    ax_m.set_ylabel("predicted peak memory per device (GiB)")
    ax_m.set_xlabel("layout (rank in the table)")
    ax_m.legend(fontsize=7)
    fig.suptitle(title or "moe.plan: top layouts (predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
