"""The pipeline benchmark's table (one row per layout, schedule and micro-batch count), its
JSON, markdown and plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.pipeline_bench.theory import theoretical_bubble

MiB = 2**20


def summarize(results: list[dict]) -> list[dict]:
    """One row per (layout, schedule, m): the pipeline's median step time, each rank's bubble
    (by rank), their mean, and the theoretical bubble."""
    table = []
    for result in results:
        pp, dp, ep = result["meta"]["layout"]
        cases: dict[tuple, list[dict]] = {}
        for r in result["rows"]:
            cases.setdefault((r["schedule"], r["microbatches"]), []).append(r)
        for (schedule, m), ranks in cases.items():
            ranks = sorted(ranks, key=lambda r: r["rank"])
            v = ranks[0]["stages_per_rank"]
            theory = theoretical_bubble(schedule, pp, m, v)
            bubbles = [r["bubble"] for r in ranks]
            parts = [r["busy_parts_s"] for r in ranks]
            fwd = sum(p["forward"] for p in parts)
            bwd = sum(p["backward"] + p["weight"] for p in parts)
            table.append(
                {
                    "pp": pp,
                    "dp": dp,
                    "ep": ep,
                    "schedule": schedule,
                    "microbatches": m,
                    "stages_per_rank": v,
                    "step_ms": 1e3 * statistics.median(ranks[0]["step_s"]),
                    "step_min_ms": 1e3 * min(ranks[0]["step_s"]),
                    "busy_ms": [1e3 * statistics.median(r["busy_s"]) for r in ranks],
                    "backward_over_forward": bwd / fwd if fwd > 0 else None,
                    "busy_on_cpu": statistics.fmean(
                        sum(r["busy_cpu_s"]) / sum(r["busy_s"]) for r in ranks
                    ),
                    "bubble": bubbles,
                    "bubble_mean": statistics.fmean(bubbles),
                    "theory": theory.value,
                    "theory_formula": theory.formula,
                    "theory_source": theory.source,
                    "step_peak_mib": [r["step_peak_bytes"] / MiB for r in ranks],
                    "param_mib": [r["param_bytes"] / MiB for r in ranks],
                    "stages": [r["stages"] for r in ranks],
                }
            )
    for row in table:
        key = (row["pp"], row["ep"], row["microbatches"])
        same = [
            r
            for r in table
            if r["schedule"] == "1F1B" and (r["pp"], r["ep"], r["microbatches"]) == key
        ]
        base = same[0] if same else None
        row["step_vs_1f1b"] = row["step_ms"] / base["step_ms"] if base else None
        row["work_vs_1f1b"] = sum(row["busy_ms"]) / sum(base["busy_ms"]) if base else None
    return table


def _list(values, fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def _bf(ratio, fmt: str = ".1f") -> str:
    return "n/a" if ratio is None else format(ratio, fmt)


def markdown(meta: dict, results: list[dict], table: list[dict]) -> str:
    m = meta
    lines = [
        f"# Pipeline schedules: measured vs theoretical bubble, {m['date']} "
        f"({m['cores']}-core CPU, gloo)",
        "",
        f"Command: `{m['command']}` (from the repository root; root for the emulated network).",
        "",
        f"Network: {m['network']}"
        + (f"; loopback because: {m['loopback_reason']}." if m["loopback_reason"] else ".")
        + f" Machine load (1-min average) {m['load_before']:.1f} before, "
        f"{m['load_after']:.1f} after.",
    ]
    if m.get("note"):
        lines += ["", m["note"]]
    lines += [
        "",
        f"Model: embedding ({m['vocab']}), {m['blocks']} pre-norm MoE blocks (d_model="
        f"{m['d_model']}, d_ff={m['d_ff']}, {m['experts']} experts, top-{m['top_k']}), head; "
        f"float32; {m['microbatch_rows']} x {m['seq']} tokens per micro-batch (the global batch "
        "grows with m). Stages hold equal block counts (the embedding with the first, the "
        "head with the last); v = stages per rank (2 for the interleaved and V schedules, so "
        "pp x v stages). data_parallel='ddp' (the zero-bubble schedules refuse fsdp). "
        f"{m['warmup']} warm-up step(s) per case, then {m['steps']} rounds of one step of every "
        "case of the layout in turn (interleaved, so drifting load touches every schedule "
        "alike); medians over the rounds.",
        "",
        "Measured: step = the slowest rank's wall time of `Pipeline.step` (forward + backward "
        "of all micro-batches, no optimizer), every rank starting after a barrier. busy = time "
        "inside PipelineStage.forward_one_chunk / backward_one_chunk / "
        "backward_weight_one_chunk and the loss (wrapped in the benchmark process; it includes "
        "an MoE layer's all-to-all at ep > 1, not P2P waits). bubble = 1 - busy / step per "
        "rank (median over steps), listed by rank, and their mean. Peak = the bytes one step "
        "adds at its peak on the rank (tensor storages counted by bench.memory."
        "AllocationCounter: activations kept for backward, gradients, temporaries), next to "
        "the rank's parameters.",
        "",
        "Caveats: one process per rank, one thread each, on "
        f"{m['cores']} cores: pp = 4 runs 4 ranks on {m['cores']} cores, so a rank's busy time "
        "includes time it was runnable but descheduled (oversubscription inflates busy "
        "time and hides bubbles). The CPU was shared with other jobs (see the load). The "
        "theoretical bubbles assume equal stage times, free communication and, for the "
        "zero-bubble schedules, T_F = T_B(input) = T_W (a full backward 2x the forward); "
        "step / 1F1B: the step time over 1F1B's at the same layout and m; work / 1F1B: the "
        "busy time summed over ranks over 1F1B's (the split backward of the zero-bubble "
        "schedules costs extra compute). "
        "busy on CPU: the rank's thread CPU time inside those calls over their wall time "
        "(mean over ranks; below 100% the rank was descheduled while busy, so its busy time "
        "is inflated and its bubble underestimated). B/F is the measured ratio (all ranks' backward + weight-backward time over their "
        "forward time, medians per step): on this small model per-op overhead makes the "
        "forward relatively expensive.",
        "",
        f"![bubbles and step times]({Path(m.get('png', 'pipeline.png')).name})",
        "",
        "| pp | ep | schedule | m | v | step ms | step / 1F1B | work / 1F1B | "
        "measured bubble (mean) | theoretical | B/F | busy on CPU | bubble by rank | "
        "busy ms by rank | step peak MiB by rank | params MiB by rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['pp']} | {r['ep']} | {r['schedule']} | {r['microbatches']} | "
            f"{r['stages_per_rank']} | {r['step_ms']:.1f} | {_bf(r['step_vs_1f1b'], '.2f')} | "
            f"{_bf(r['work_vs_1f1b'], '.2f')} | "
            f"{r['bubble_mean']:.2f} | "
            f"{r['theory']:.2f} | {_bf(r['backward_over_forward'])} | "
            f"{r['busy_on_cpu']:.0%} | "
            f"{_list(r['bubble'], '.2f')} | {_list(r['busy_ms'], '.1f')} | "
            f"{_list(r['step_peak_mib'], '.2f')} | {_list(r['param_mib'], '.2f')} |"
        )
    skipped = [(res["meta"]["layout"], s) for res in results for s in res.get("skipped", [])]
    if skipped:
        lines += ["", "Not run (the schedule's own rule):", ""]
        lines += [
            f"- pp={lay[0]} ep={lay[2]} {s['schedule']} m={s['microbatches']}: {s['reason']}"
            for lay, s in skipped
        ]
    lines += ["", "Theoretical bubble per schedule (p ranks, m micro-batches, v stages per rank):"]
    lines += [""]
    seen = set()
    for r in table:
        if r["schedule"] not in seen:
            seen.add(r["schedule"])
            lines.append(f"- {r['schedule']}: {r['theory_formula']}; {r['theory_source']}")
    first = table[0]["stages"] if table else []
    if first:
        lines += ["", "Stages by rank (first row): " + " / ".join(str(s) for s in first)]
    return "\n".join(lines) + "\n"


def plot(path: Path, table: list[dict]) -> None:
    """Per layout: measured (bars) vs theoretical (markers) bubble per schedule and m; below,
    the step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys((r["pp"], r["dp"], r["ep"]) for r in table))
    ms = sorted({r["microbatches"] for r in table})
    fig, axes = plt.subplots(2, len(layouts), figsize=(5.5 * len(layouts), 7), squeeze=False)
    width = 0.8 / len(ms)
    for col, lay in enumerate(layouts):
        rows = [r for r in table if (r["pp"], r["dp"], r["ep"]) == lay]
        names = list(dict.fromkeys(r["schedule"] for r in rows))
        top, bottom = axes[0][col], axes[1][col]
        for k, m in enumerate(ms):
            xs, measured, theory, steps = [], [], [], []
            for i, name in enumerate(names):
                hit = [r for r in rows if r["schedule"] == name and r["microbatches"] == m]
                if hit:
                    xs.append(i + (k - (len(ms) - 1) / 2) * width)
                    measured.append(hit[0]["bubble_mean"])
                    theory.append(hit[0]["theory"])
                    steps.append(hit[0]["step_ms"])
            top.bar(xs, measured, width, color=f"C{k}", label=f"measured, m={m}")
            top.plot(xs, theory, "k_", ms=14, mew=2, label="theoretical" if k == 0 else None)
            bottom.bar(xs, steps, width, color=f"C{k}", label=f"m={m}")
        for ax in (top, bottom):
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
            ax.grid(True, axis="y", alpha=0.3)
        top.set_ylim(0, 1)
        top.set_ylabel("bubble (mean over ranks)")
        top.set_title(f"pp={lay[0]} dp={lay[1]} ep={lay[2]}", fontsize=9)
        bottom.set_ylabel("step time (ms)")
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(prefix: Path, meta: dict, results: list[dict], table: list[dict]) -> list:
    """PREFIX.json (meta, table, every rank's raw record), PREFIX.md, PREFIX.png."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    js, md, png = (prefix.with_name(prefix.name + ext) for ext in (".json", ".md", ".png"))
    meta = {**meta, "png": png.name}
    js.write_text(json.dumps({"meta": meta, "table": table, "layouts": results}, indent=1))
    plot(png, table)
    md.write_text(markdown(meta, results, table))
    return [js, md, png]


def main(argv=None) -> None:
    """`python -m bench.pipeline_bench.report OUT.json`: OUT.md / .png (and the JSON's table)
    written again from the JSON's raw records, e.g. after a change of the report."""
    import sys

    (path,) = sys.argv[1:] if argv is None else argv
    data = json.loads(Path(path).read_text())
    prefix = Path(path).with_suffix("")
    write_outputs(prefix, data["meta"], data["layouts"], summarize(data["layouts"]))


if __name__ == "__main__":
    main()
