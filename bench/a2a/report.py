"""The markdown report: per-run tables, cost-model check, limits, projection, plots."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import textwrap
from dataclasses import asdict
from pathlib import Path

import torch

from bench.a2a.model import GPU_CLUSTER, fit_model, model_check, projection_table
from bench.a2a.tables import TABLE_ALGOS, algo_table, compares_hier, comparison_table
from moe.comm.cost_model import CostModel, save_profile

PROJECTION_SIZES = [1 << (10 + 2 * i) for i in range(9)]  # 1 KiB .. 64 MiB, x4


def limits_section(results: dict[str, dict]) -> str:
    """What this run cannot show, from its own ranks and this machine's cores."""
    cores = os.cpu_count() or 1
    worlds = sorted({res["meta"]["world_size"] for res in results.values()})
    most = max(worlds, default=0)
    share = (
        f"- {most} ranks on {cores} CPU cores: oversubscribed, so small-message times measure "
        "process scheduling more than communication."
        if most > cores
        else f"- {most} ranks on {cores} CPU cores: one core per rank at most."
    )
    return "\n".join([
        "## What this machine cannot show",
        "",
        "- No per-message latency: netem is unavailable, so the emulated network shapes "
        "bandwidth (tbf) but adds no propagation delay. Real networks charge microseconds per "
        "message, which is what the hierarchical path saves; here that saving is mostly invisible.",
        share,
        "- gloo over TCP is not NCCL over NVLink / InfiniBand: absolute numbers say nothing "
        "about GPUs.",
        "",
    ])  # fmt: skip


def machine_line(results: dict[str, dict]) -> str:
    """Cores, ranks and the load average seen at the end of the run (other jobs show there)."""
    cores = os.cpu_count() or 1
    worlds = ", ".join(str(w) for w in sorted({r["meta"]["world_size"] for r in results.values()}))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    over = (
        " (more ranks than cores)"
        if any(r["meta"]["world_size"] > cores for r in results.values())
        else ""
    )
    busy = max(r["meta"]["world_size"] for r in results.values()) if results else 0
    shared = " (above the rank count: other jobs shared the machine)" if load > busy else ""
    return (
        f"Machine: {cores}-core CPU, torch {torch.__version__}, gloo over TCP, {worlds} ranks"
        f"{over}, every rank 1 intra-op thread; 1-minute load average {load:.1f} when the "
        f"report was written{shared}."
    )


def targets_section(results: dict[str, dict], model: CostModel | None) -> list[str]:
    """Each target of the issue with the measured numbers it is judged on."""
    out = ["## Targets (computed from the tables above)", ""]
    med = statistics.median
    for name, res in results.items():
        if res["meta"]["uneven"]:
            continue
        t = [r["time_us"] for r in res["rows"]]
        big = [r["time_us"] for r in res["rows"] if r["size"] >= 4 << 20] or t
        within = sum(abs(x["flat*"] / x["raw"] - 1) <= 0.05 for x in t)
        out.append(
            f"- flat within 5% of raw ({name}): data path flat*/raw median "
            f"{med(x['flat*'] / x['raw'] for x in t):.3f} (within 5% at {within}/{len(t)} "
            f"sizes); full call flat/raw median {med(x['flat'] / x['raw'] for x in t):.3f}, "
            f"largest sizes (>= 4 MiB) {med(x['flat'] / x['raw'] for x in big):.3f}; flat/(raw+cnt) median "
            f"{med(x['flat'] / x['raw+cnt'] for x in t):.3f}"
        )
    emu = results.get("emulated 2x4, even")
    if emu is not None:
        small = [r["time_us"] for r in emu["rows"] if r["size"] <= 256 << 10]
        full = [x["flat"] / x["hier"] for x in small]
        data = [x["flat*"] / x["hier*"] for x in small]
        out.append(
            f"- emulated 2x4, hier/flat busbw >= 1.3 up to 256 KiB: full call "
            f"{min(full):.2f}..{max(full):.2f}, data path {min(data):.2f}..{max(data):.2f}"
        )
        for r in emu["rows"]:
            if r["size"] == 16 << 20:
                x = r["time_us"]
                out.append(
                    f"- emulated 2x4, hier/flat busbw >= 0.9 at 16 MiB: full call "
                    f"{x['flat'] / x['hier']:.2f}, data path {x['flat*'] / x['hier*']:.2f}"
                )
        if model is not None:
            check = model_check(model, emu)
            worst_d = max(abs(e["data"]["rel_err"]) for e in check)
            worst_f = max(abs(e["full"]["rel_err"]) for e in check)
            n_ok = sum(abs(e["data"]["rel_err"]) <= 0.25 for e in check)
            out.append(
                f"- cost model ratio within 25% of measured: data path worst {worst_d:.0%} "
                f"({n_ok}/{len(check)} sizes within 25%), full call worst {worst_f:.0%}"
            )
    return out + [""]


def plot_section(path: Path, results: dict[str, dict], model: CostModel | None) -> list[str]:
    """Draw the PNGs next to the report (skipped with a note when matplotlib is missing)."""
    try:
        from bench.a2a.plots import plot_busbw
    except ImportError as e:
        return [f"(plots skipped: {e})", ""]
    out = ["## Plots", ""]
    for name, res in results.items():
        if res["meta"]["uneven"]:
            continue
        png = path.with_name(f"{path.stem}-{name.split(',')[0].replace(' ', '-')}.png")
        emulated = "emulated" in name
        plot_busbw(png, res, name, model if emulated else None)
        out += [f"![{name}]({png.name})", ""]
    return out


def write_report(path: Path, results: dict[str, dict], cfgs: dict[str, dict], argv: str) -> None:
    lines = [
        f"# All-to-all on CPU (gloo): raw vs flat vs hierarchical — "
        f"{datetime.date.today().isoformat()}",
        "",
        f"Command: `{argv}`",
        "",
        machine_line(results),
        "",
    ]
    for name, res in results.items():
        meta, cfg = res["meta"], cfgs[name]
        W, L = meta["world_size"], meta["ranks_per_node"]
        one_node = (
            " One node: the hierarchical exchange is the flat one, so its ratios are n/a."
            if not compares_hier(W, L)
            else ""
        )
        lines += [
            f"## {name}",
            "",
            f"{W} ranks, 2D layout {W // L}x{L}, "
            f"{'uneven' if meta['uneven'] else 'even'} splits, float32, "
            f"sizes {cfg['min_bytes']}..{cfg['max_bytes']} B x{cfg['factor']}.{one_node}",
            "",
        ]
        if "emulate" in name:
            lines += [
                f"tbf: rate {cfg['rate_mbit']} Mbit/s per direction per node link, "
                f"burst {cfg['burst_kb']} KiB, latency (queue bound) {cfg['latency_ms']} ms.",
                "",
                "tbf counters after the run:",
                "",
                "```",
                meta.get("tbf_stats", ""),
                "```",
                "",
            ]
        for algo, what in TABLE_ALGOS.items():
            lines += [f"### {algo}: {what}", "", algo_table(res["rows"], W, algo), ""]
        lines += ["### comparison (busbw ratios)", "", comparison_table(res["rows"], W, L), ""]
    model = None
    loops = [n for n in results if n.startswith("loopback") and n.endswith(", even")]
    if "emulated 2x4, even" in results and loops:
        emu, loop = results["emulated 2x4, even"], results[loops[0]]
        model = fit_model(loop, emu)
        profile = path.with_name(path.stem + "-profile.json")
        save_profile(model, profile, meta={"from": path.name, "machine": "2-core CPU, gloo"})
        lines += [
            "## Cost model (moe.comm.cost_model)",
            "",
            "Fitted on the loopback run and the emulated raw column only (the emulated flat and",
            f"hierarchical columns are left to check it); saved as `{profile.name}`",
            "(`MOE_A2A_COST_PROFILE` or `set_cost_model(load_profile(...))` make `auto` use it):",
            "",
            "```",
            json.dumps(asdict(model), indent=1),
            "```",
            "",
            "Emulated 2x4: hier/flat busbw predicted vs measured (reused plan; full call):",
            "",
            "| size (B) | predicted | measured | error | predicted full | measured full |",
            "|" + "---:|" * 6,
        ]
        for e in model_check(model, emu):
            d, f = e["data"], e["full"]
            lines.append(
                f"| {e['size']} | {d['pred_ratio']:.2f} | {d['meas_ratio']:.2f} | "
                f"{d['rel_err']:+.0%} | {f['pred_ratio']:.2f} | {f['meas_ratio']:.2f} |"
            )
        lines += [""]
    lines += [
        limits_section(results),
        "## Projection (not a measurement): 8 nodes x 8 GPUs",
        "",
        "PROJECTION from `moe.comm.cost_model.NVLINK_IB` (NVLink 450 GB/s per GPU per direction,",
        "InfiniBand 50 GB/s per GPU; per-message and per-collective costs are assumptions):",
        "",
        "```",
        json.dumps(asdict(GPU_CLUSTER), indent=1),
        "```",
        "",
        projection_table(GPU_CLUSTER, 8, 8, PROJECTION_SIZES),
        "",
        f"`auto` picks hierarchical up to {GPU_CLUSTER.crossover_bytes(8, 8)} bytes per rank "
        f"there (2 x 8: {GPU_CLUSTER.crossover_bytes(2, 8)}; 2 x 4: never).",
        "",
    ]
    lines += plot_section(path, results, model)
    lines += targets_section(results, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(wrap_100("\n".join(lines)))
    print(f"wrote {path}")


def wrap_100(text: str, width: int = 100) -> str:
    """Prose, bullets and code-block lines folded at `width` columns (tables are narrow)."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if len(line) <= width or line.startswith("|") or line.startswith("```"):
            out.append(line)
            continue
        indent = "  " if in_code or line.startswith("- ") else ""
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")
