"""Predicted against measured: moe.plan.predict of every measured layout with the cluster file
the profile run wrote for its link rate, the errors, the issue-48 statistics, the table, the
scatter plot and the JSON."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import numpy as np

from bench.plan_measured_lib.models import Sizes, spec_of
from moe.plan.cluster import Cluster
from moe.plan.layout import Layout
from moe.plan.predict import predict

TARGETS = {"median": 0.15, "p90": 0.30, "spearman": 0.8, "best_gap": 0.10, "memory": 0.10}


def add_predictions(rows: list[dict], cluster: Cluster, sizes: Sizes) -> list[dict]:
    """Each measured row with its Prediction's step time, terms, peak memory and errors."""
    out = []
    for row in rows:
        layout = Layout(**row["layout"])
        spec, seq_len = spec_of(row["model"], sizes)
        tokens = layout.microbatches * layout.micro_batch_seqs * seq_len * layout.dp * layout.ep
        p = predict(spec, cluster, layout, seq_len, tokens)
        out.append({
            **row,
            "short": layout.short(),
            "predicted_time": p.step_time,
            "predicted_terms": p.time,
            "predicted_memory": p.peak_memory,
            "predicted_memory_terms": p.memory,
            "time_error": abs(p.step_time - row["step_time"]) / row["step_time"],
            "memory_error": abs(p.peak_memory - row["peak_memory"]) / row["peak_memory"],
        })  # fmt: skip
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):  # ties share their mean rank
        r[x == v] = r[x == v].mean()
    return r


def spearman(a, b) -> float:
    ra, rb = _ranks(np.asarray(a, float)), _ranks(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _best_pairs(rows: list[dict]) -> list[tuple[str, dict, dict]]:
    """Per (model, rate): its name, the predicted-best row and the measured-best row."""
    out = []
    for key in sorted({(r["model"], r["rate_mbit"]) for r in rows}, key=str):
        group = [r for r in rows if (r["model"], r["rate_mbit"]) == key]
        chosen = min(group, key=lambda r: r["predicted_time"])
        best = min(group, key=lambda r: r["step_time"])
        out.append((f"{key[0]} @ {key[1]}", chosen, best))
    return out


def finalists(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(predicted-best row, measured-best row) of each group where they differ: the two
    layouts the best-layout gap compares, for a head-to-head rerun."""
    return [(chosen, best) for _, chosen, best in _best_pairs(rows) if chosen is not best]


def _gaps(rows: list[dict]) -> tuple[dict, dict]:
    """Per group, the predicted-best layout's gap to the measured best: from the passes, and
    as judged (head to head where both rows have final_times: the median of each one's
    alternating reruns, at least 0; else the passes' gap)."""
    passes, judged = {}, {}
    for name, chosen, best in _best_pairs(rows):
        passes[name] = judged[name] = chosen["step_time"] / best["step_time"] - 1
        if chosen is not best and "final_times" in chosen and "final_times" in best:
            ratio = np.median(chosen["final_times"]) / np.median(best["final_times"])
            judged[name] = max(float(ratio) - 1, 0.0)
    return passes, judged


def summary(rows: list[dict]) -> dict:
    """The issue's statistics over every row; the best-layout gap per (model, rate), judged
    head to head where the finalists were rerun (_gaps)."""
    err = np.array([r["time_error"] for r in rows])
    passes, gaps = _gaps(rows)
    s = {
        "layouts": len(rows),
        "median": float(np.median(err)),
        "p90": float(np.percentile(err, 90)),
        "spearman": spearman([r["predicted_time"] for r in rows], [r["step_time"] for r in rows]),
        "best_gap": max(gaps.values()),
        "best_gap_by_group": gaps,
        "best_gap_passes_by_group": passes,
        "memory": max(r["memory_error"] for r in rows),
        "memory_median": float(np.median([r["memory_error"] for r in rows])),
    }
    s["met"] = {
        "median": s["median"] <= TARGETS["median"],
        "p90": s["p90"] <= TARGETS["p90"],
        "spearman": s["spearman"] >= TARGETS["spearman"],
        "best_gap": s["best_gap"] <= TARGETS["best_gap"],
        "memory": s["memory"] <= TARGETS["memory"],
    }
    return s


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | link | layout | measured ms | predicted ms | error | measured MiB | "
        "predicted MiB | error | peak in (measured / predicted) | largest predicted terms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        terms = sorted(r["predicted_terms"].items(), key=lambda kv: -kv[1])[:3]
        top = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in terms if v > 0)
        mem = r["predicted_memory_terms"]
        phase = f"{_measured_phase(r)} / " + (
            "step" if mem["temporaries"] > mem["activations"] + mem["comms"] else "backward"
        )
        lines.append(
            f"| {r['model']} | {r['rate_mbit']} Mbit/s | {r['short']} | "
            f"{r['step_time'] * 1e3:.1f} | {r['predicted_time'] * 1e3:.1f} | "
            f"{r['time_error']:.0%} | {r['peak_memory'] / 2**20:.2f} | "
            f"{r['predicted_memory'] / 2**20:.2f} | {r['memory_error']:.0%} | {phase} | {top} |"
        )
    return lines


def _finals(rows: list[dict]) -> list[str]:
    """The head-to-head reruns, one line each."""
    return [
        f"Head to head, {r['model']} @ {r['rate_mbit']}: {r['short']} "
        f"{', '.join(f'{t * 1e3:.0f}' for t in r['final_times'])} ms"
        for r in rows
        if "final_times" in r
    ]


def _measured_phase(row: dict) -> str:
    """Where the measured peak was: forward + backward or the optimizer step ("?" for a
    report from before the phases were measured)."""
    if "optimizer_peak" not in row:
        return "?"
    return "step" if row["optimizer_peak"] > row["backward_peak"] else "backward"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, (meas, pred, unit, scale) in zip(
        axes,
        (("step_time", "predicted_time", "step time (ms)", 1e3),
         ("peak_memory", "predicted_memory", "peak memory per rank (MiB)", 1 / 2**20)),
    ):  # fmt: skip
        for model, marker in (("m6", "o"), ("mixtral", "s")):
            for rate in sorted({r["rate_mbit"] for r in rows}):
                pts = [r for r in rows if r["model"] == model and r["rate_mbit"] == rate]
                if pts:
                    ax.scatter([r[meas] * scale for r in pts], [r[pred] * scale for r in pts],
                               marker=marker, label=f"{model}, {rate} Mbit/s")  # fmt: skip
        values = [r[k] * scale for r in rows for k in (meas, pred)]
        lo, hi = min(values) / 1.3, max(values) * 1.3
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], alpha=0.15)
        ax.set(xscale="log", yscale="log", xlabel=f"measured {unit}", ylabel=f"predicted {unit}")
        ax.legend(fontsize=7)
    fig.suptitle("moe.plan predicted vs measured (band: +-15 %)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict], meta: dict, stem: Path) -> dict:
    """stem.json, stem.png and stem.md; returns the summary."""
    s = summary(rows)
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(
        json.dumps({"meta": meta, "summary": s, "rows": rows}, indent=1)
    )
    plot(rows, Path(f"{stem}.png"))
    ok = {True: "met", False: "NOT met"}
    lines = [
        f"# moe.plan: predicted vs measured ({meta['date']}, {meta['machine']})", "",
        *([f"**{meta['warning']}**", ""] if meta.get("warning") else []),
        f"Command: `{meta['command']}`", "",
        meta["setup"], "",
        "| statistic | value | target | |", "|---|---:|---:|---|",
        f"| median time error | {s['median']:.1%} | <= 15 % | {ok[s['met']['median']]} |",
        f"| 90th percentile time error | {s['p90']:.1%} | <= 30 % | {ok[s['met']['p90']]} |",
        f"| Spearman (predicted, measured) | {s['spearman']:.2f} | >= 0.8 | "
        f"{ok[s['met']['spearman']]} |",
        f"| predicted-best vs measured-best (worst group) | {s['best_gap']:.1%} | <= 10 % | "
        f"{ok[s['met']['best_gap']]} |",
        f"| peak memory error (worst layout) | {s['memory']:.1%} | <= 10 % | "
        f"{ok[s['met']['memory']]} |",
        f"| peak memory error (median) | {s['memory_median']:.1%} | | |", "",
        "Best-layout gap per group, as judged (head to head where the predicted-best and the "
        "measured-best layout differ): " + ", ".join(
            f"{k} {v:.1%}" for k, v in s["best_gap_by_group"].items()) + "; from the passes: "
        + ", ".join(f"{k} {v:.1%}" for k, v in s["best_gap_passes_by_group"].items()) + ".",
        *_finals(rows), "",
        f"![predicted vs measured]({stem.name}.png)", "",
        *table(rows), "",
        "Profiled clusters (held out: micro-benchmarks, no layout run):", "",
        *[f"- {rate} Mbit/s: `{json.dumps(c)}`" for rate, c in meta["clusters"].items()], "",
    ]  # fmt: skip
    Path(f"{stem}.md").write_text("\n".join(lines))
    return s


LAYOUT_FIELDS = {f.name for f in fields(Layout)}
MEASURED = ("model", "layout", "rate_mbit", "step_time", "step_times", "pass_times", "peak_memory",
            "resident_memory", "host_memory", "backward_peak", "optimizer_peak",
            "final_times")  # fmt: skip


def repredict(path: Path) -> tuple[list[dict], dict]:
    """(rows, meta) of an earlier report's JSON, predicted again by today's moe.plan from its
    measured rows and profiled clusters (untrusted input: sizes and fields checked)."""
    from moe.untrusted import read_json

    doc = read_json(path, max_bytes=16 << 20, what="plan_measured report")
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: not a bench.plan_measured report (no rows)")
    meta, rows = doc.get("meta"), []
    if not isinstance(meta, dict) or not isinstance(meta.get("clusters"), dict):
        raise ValueError(f"{path}: not a bench.plan_measured report (no profiled clusters)")
    names = {f.name for f in fields(Sizes)}
    if not isinstance(meta.get("sizes"), dict) or not set(meta["sizes"]) <= names:
        raise ValueError(f"{path}: the report's model sizes must be Sizes fields {sorted(names)}")
    sizes = Sizes(**meta["sizes"])
    clusters = {rate: Cluster(**c) for rate, c in meta["clusters"].items()}
    for r in doc["rows"]:
        if not isinstance(r, dict) or r.get("model") not in ("m6", "mixtral"):
            raise ValueError(f"{path}: a row is not a measured layout of m6 or mixtral")
        if str(r.get("rate_mbit")) not in clusters:
            raise ValueError(f"{path}: row at rate {r.get('rate_mbit')!r} has no profile")
        if not all(
            isinstance(r.get(k), (int, float)) and r[k] > 0 for k in ("step_time", "peak_memory")
        ):
            raise ValueError(f"{path}: a row's step_time or peak_memory is not positive")
        for k in ("backward_peak", "optimizer_peak"):  # optional: the phases' peaks
            if k in r and not (isinstance(r[k], (int, float)) and r[k] >= 0):
                raise ValueError(f"{path}: a row's {k} is not a number >= 0")
        finals = r.get("final_times")  # optional: the head-to-head reruns
        if finals is not None and not (
            isinstance(finals, list) and finals
            and all(isinstance(t, (int, float)) and t > 0 for t in finals)
        ):  # fmt: skip
            raise ValueError(f"{path}: a row's final_times is not a list of times > 0")
        if not isinstance(r.get("layout"), dict) or not set(r["layout"]) <= LAYOUT_FIELDS:
            raise ValueError(
                f"{path}: a row's layout must be Layout fields {sorted(LAYOUT_FIELDS)}"
            )
        row = {k: r[k] for k in MEASURED if k in r}
        rows += add_predictions([row], clusters[str(r["rate_mbit"])], sizes)
    return rows, meta
