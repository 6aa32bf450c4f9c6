"""moe.plan's --plot memory panel draws what the table says (issue 62 item 9): the resident
terms, then the forward / backward and the optimizer step's memory side by side, never live at
once, so each layout's tallest bar ends at its predicted peak (it stacked all six terms: 86.7
GiB drawn where the table said 75.9)."""

from dataclasses import replace

import matplotlib
import pytest

from moe.plan import load_model, preset, search
from moe.plan import report as R
from moe.plan.predict import MEMORY_TERMS

matplotlib.use("Agg")


def test_memory_bars_end_at_the_predicted_peak(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    result = search(load_model("qwen3-30b-a3b"), preset("h100", nodes=2), 512 * 4096, 4096, top=4)
    preds = list(result.fits)
    first = preds[0]  # and one whose optimizer step holds more than forward / backward
    temps = first.memory["activations"] + first.memory["comms"] + 3 * R.GiB
    preds.append(replace(first, memory={**first.memory, "temporaries": temps}))
    assert all(p.memory["temporaries"] > 0 and p.memory["activations"] > 0 for p in preds)
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    R.plot(preds, tmp_path / "plan.png")
    ax = figures[0].axes[1]  # the memory panel
    for i, p in enumerate(preds):
        tops = [
            b.get_y() + b.get_height()
            for b in ax.patches
            if abs(b.get_x() + b.get_width() / 2 - i) < 0.5
        ]
        assert max(tops) == pytest.approx(p.peak_memory / R.GiB, rel=1e-12), i
        assert sum(p.memory.values()) / R.GiB > max(tops) + 1e-3  # the sum would overstate it
    # every term drawn once
    assert set(R.RESIDENT) | {t for _, terms, _ in R.PHASES for t in terms} == set(MEMORY_TERMS)
