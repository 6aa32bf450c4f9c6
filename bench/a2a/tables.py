"""nccl-tests style tables: one narrow table per algorithm, one comparison table, console lines.

size = bytes of one rank's whole send buffer (uneven: the largest), count = elements per peer,
algbw = size / time, busbw = algbw * (n - 1) / n (GB/s).
"""

from __future__ import annotations

# Columns of the timed variants: raw all_to_all_single; moe flat / hierarchical full calls
# (validation, count exchange, token exchange); flat* / hier*: token exchange with a reused plan.
TABLE_ALGOS = {
    "raw": "raw torch all_to_all_single (split sizes known)",
    "flat": "moe flat, full call (validation + count exchange + tokens)",
    "hier": "moe hierarchical, full call (count all_gather + 2D tokens)",
    "flat*": "moe flat, reused plan (tokens only)",
    "hier*": "moe hierarchical, reused plan (tokens only)",
}

# What the console lines and the PNG show, in this order (the same numbers in both).
PLOTTED = ("raw", "flat", "hier", "flat*", "hier*")


def fmt_bw(gbps: float) -> str:
    """GB/s with 4 significant digits: small sizes never print as 0.000."""
    return f"{gbps:.4g}"


def compares_hier(W: int, L: int) -> bool:
    """The hierarchical exchange differs from the flat one only across 2 or more nodes."""
    return W // L >= 2


def busbw(size: int, time_us: float, W: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s."""
    algbw = size / (time_us * 1e-6) / 1e9
    return algbw, algbw * (W - 1) / W


def wrong_cell(row: dict, algo: str) -> str:
    wrong = row.get("wrong", {})
    return str(wrong[algo]) if algo in wrong else "n/a"


def algo_table(rows: list[dict], W: int, algo: str, markdown: bool = True) -> str:
    """One algorithm: size, count, type, time, algbw, busbw, #wrong."""
    head = ["size (B)", "count", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)"]
    checked = any("wrong" in row for row in rows)
    head += ["#wrong"] if checked else []
    body = []
    for row in rows:
        t = row["time_us"][algo]
        a, b = busbw(row["size"], t, W)
        body.append(
            [
                str(row["size"]),
                str(row["count"]),
                "float",
                f"{t:.1f}",
                fmt_bw(a),
                fmt_bw(b),
            ]
            + ([wrong_cell(row, algo)] if checked else [])
        )
    return _render(head, body, markdown)


def comparison_table(rows: list[dict], W: int, L: int, markdown: bool = True) -> str:
    """Busbw ratios per size: flat/raw and hierarchical/flat, full call and reused plan;
    the hierarchical ratios are n/a on one node (W // L = 1: the same exchange as flat)."""
    head = ["size (B)", "flat/raw", "hier/flat", "flat*/raw", "hier*/flat*"]
    body = []
    for row in rows:
        t = row["time_us"]
        hier = compares_hier(W, L)
        body.append(
            [
                str(row["size"]),
                f"{t['raw'] / t['flat']:.2f}",
                f"{t['flat'] / t['hier']:.2f}" if hier else "n/a (1 node)",
                f"{t['raw'] / t['flat*']:.2f}",
                f"{t['flat*'] / t['hier*']:.2f}" if hier else "n/a (1 node)",
            ]
        )
    return _render(head, body, markdown)


def _render(head: list[str], body: list[list[str]], markdown: bool) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def console_line(row: dict, W: int, L: int) -> str:
    """One finished size: busbw (GB/s) of every column the PNG draws, and hier/flat."""
    t = row["time_us"]
    cells = " ".join(f"{a}={fmt_bw(busbw(row['size'], t[a], W)[1]):>9}" for a in PLOTTED)
    ratio = f"hier/flat={t['flat'] / t['hier']:.2f}" if compares_hier(W, L) else "hier n/a (1 node)"
    return f"{row['size']:>10d} B busbw GB/s {cells} {ratio}"


def console_tables(rows: list[dict], W: int, L: int) -> str:
    """The report's tables, aligned as plain text."""
    parts = []
    for algo, what in TABLE_ALGOS.items():
        parts += [f"# {algo}: {what}", algo_table(rows, W, algo, markdown=False), ""]
    parts += ["# comparison (busbw ratios)", comparison_table(rows, W, L, markdown=False)]
    return "\n".join(parts)
