"""Markdown report and PNG plot of bench/overlap.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def summarise(row: dict) -> dict:
    """Ideal, and the share of min(exchange, experts) that each overlapped variant hid."""
    t = row["median_s"]
    ideal = max(t["exchange"], t["experts"])
    smaller = min(t["exchange"], t["experts"])
    variants = [n for n in t if n.startswith("n=") or n == "auto"]
    hidden = {n: (t["plain"] - t[n]) / smaller for n in variants}
    return {"ideal": ideal, "smaller": smaller, "hidden": hidden, "variants": variants}


def cpu_floor(row: dict, cores: int) -> float | None:
    """Seconds the plain layer's CPU work (all ranks) takes on `cores` cores: no dispatcher
    can run the layer faster on this machine. Where it exceeds the exchange alone, the cores,
    not the link, bound the layer."""
    cpu = row.get("median_cpu_s", {}).get("plain")
    return None if cpu is None else cpu / cores


def auto_picks(row: dict) -> str:
    """The degrees auto ran at over the measured rounds, e.g. "n=4 x13"."""
    if "auto_degrees" not in row:  # older results: the last degree only
        return f"n={row['auto_degree']}"
    counts = Counter(row["auto_degrees"])
    return ", ".join(f"n={n} x{k}" for n, k in sorted(counts.items(), key=lambda c: -c[1]))


def plot(path: Path, rows: list[dict]) -> None:
    names = ["exchange", "experts", "plain"] + summarise(rows[0])["variants"] + ["ideal"]
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [
            (summarise(r)["ideal"] if name == "ideal" else r["median_s"][name]) * 1e3 for r in rows
        ]
        xs = [k + (i - len(names) / 2) * width for k in range(len(rows))]
        ax.bar(xs, values, width, label=name, hatch="//" if name == "ideal" else None)
    ax.set_xticks(range(len(rows)), [f"{r['rate_mbit']} Mbit/s" for r in rows])
    ax.set_ylabel("forward + backward, ms (slowest rank, median)")
    ax.set_title("One MoE layer on 4 gloo ranks, emulated 2x2 network")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(path: Path, meta: dict, rows: list[dict]) -> None:
    png = path.with_suffix(".png")
    plot(png, rows)
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    variants = summarise(rows[0])["variants"]
    head = ["link", "exchange", "experts", "plain", *variants, "ideal", "auto picks"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cores = meta.get("cores", 2)
    hid = ["link", "CPU floor", "bound by", *[f"{v} hid" for v in variants]]
    hidden_lines = ["| " + " | ".join(hid) + " |", "|" + "---|" * len(hid)]
    for r in rows:
        s, t = summarise(r), r["median_s"]
        ms = [f"{t[n] * 1e3:.0f}" for n in ("exchange", "experts", "plain", *variants)]
        cells = [f"{r['rate_mbit']} Mbit/s", *ms, f"{s['ideal'] * 1e3:.0f}"]
        lines.append("| " + " | ".join(cells + [auto_picks(r)]) + " |")
        floor = cpu_floor(r, cores)
        bound = "?" if floor is None else ("link" if t["exchange"] > floor else "cores")
        pct = [f"{s['hidden'][v] * 100:.0f}%" for v in variants]
        floor_ms = "-" if floor is None else f"{floor * 1e3:.0f}"
        link = f"{r['rate_mbit']} Mbit/s"
        hidden_lines.append("| " + " | ".join([link, floor_ms, bound, *pct]) + " |")
    names = ["exchange", "experts", "plain", *variants]
    split = ["| link | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    cpu = list(split)
    for r in rows:
        if "median_forward_s" not in r:
            continue
        f, b = r["median_forward_s"], r["median_backward_s"]
        cells = [f"{f[n] * 1e3:.0f} + {b[n] * 1e3:.0f}" for n in names]
        split.append("| " + " | ".join([f"{r['rate_mbit']} Mbit/s", *cells]) + " |")
        if "median_cpu_s" in r:
            c = r["median_cpu_s"]
            cpu.append(
                "| "
                + " | ".join([f"{r['rate_mbit']} Mbit/s", *[f"{c[n] * 1e3:.0f}" for n in names]])
                + " |"
            )
    loads = ", ".join(f"{r['load_before']:.1f} -> {r['load_after']:.1f}" for r in rows)
    text = f"""# Overlapped expert-parallel dispatch, {meta["date"]} ({cores}-core CPU, gloo)

Command: `python -m bench.overlap --emulate {meta["emulate"]} --rates {meta["rates"]}
--tokens {meta["tokens"]} --d-model {meta["d_model"]} --d-ff {meta["d_ff"]} --experts
{meta["experts"]} --top-k {meta["top_k"]} --rounds {meta["rounds"]}` (root: network namespaces).

One MoELayer (d_model={meta["d_model"]}, d_ff={meta["d_ff"]}, {meta["experts"]} experts, top-{meta["top_k"]},
{meta["tokens"]} tokens per rank, float32, gelu, torch backend) parallelized over 4 gloo ranks
(ep=4, flat all-to-all) laid out as {meta["emulate"]} nodes: ranks of one node talk over the
namespace's loopback, nodes over a veth pair shaped by `tc tbf` in each direction (burst
{meta["burst_kb"]} kB; a burst below the 64 kB GSO packet makes tbf cut every packet into
1500-byte frames in software, which costs each rank ~10 ms of CPU per all-to-all). Each rank has one intra-op thread. Times: forward + backward of the
layer in ms, the slowest rank's time per round, median of {meta["rounds"]} interleaved rounds.
exchange = the layer's four all-to-alls alone (dispatch, combine, their gradients) on the same
rows; experts = the local experts' forward + backward alone on the same rows; ideal =
max(exchange, experts); auto = overlap="auto" with a link model fitted from two exchanges
(t = a + b * S), measured after its exploration calls (plain and pipelined alternate until
each has 3 kept forward times); auto picks = the degrees it ran at over the measured rounds. Machine load
(1-min load average, before -> after each rate; the benchmark's own 4 ranks make about 4):
{loads}.

![times]({png.name})

{chr(10).join(lines)}

Share of min(exchange, experts) hidden, (plain - t) / min(exchange, experts); goal >= 60%.
CPU floor = the plain layer's CPU time (all ranks) / {cores} cores: no dispatcher runs the
layer faster here. Bound by "link" where the exchange alone takes longer than that floor (the
condition the benchmark is for: the network is the bottleneck), "cores" where the 4 ranks'
CPU work does (then the overlap can only hide what the cores leave idle):

{chr(10).join(hidden_lines)}

Forward + backward, ms (each the slowest rank's, median over rounds; they need not add up to
the total above, whose slowest rank may differ):

{chr(10).join(split)}

CPU time of one call, ms, all 4 ranks together (user + system, so the kernel's network path
is counted; the {cores} cores give {cores} ms per ms of wall time):

{chr(10).join(cpu)}
"""
    path.write_text(text)
