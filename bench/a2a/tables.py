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
                f"{a:.4f}",
                f"{b:.4f}",
            ]
            + ([wrong_cell(row, algo)] if checked else [])
        )
    return _render(head, body, markdown)


def comparison_table(rows: list[dict], W: int, markdown: bool = True) -> str:
    """Busbw ratios per size: flat/raw and hierarchical/flat, full call and reused plan."""
    head = ["size (B)", "flat/raw", "hier/flat", "flat*/raw", "hier*/flat*"]
    body = []
    for row in rows:
        t = row["time_us"]
        body.append(
            [
                str(row["size"]),
                f"{t['raw'] / t['flat']:.2f}",
                f"{t['flat'] / t['hier']:.2f}",
                f"{t['raw'] / t['flat*']:.2f}",
                f"{t['flat*'] / t['hier*']:.2f}",
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


def console_line(row: dict, W: int) -> str:
    """One finished size: busbw of raw / flat / hier (aligned, under 100 columns)."""
    t = row["time_us"]
    cells = " ".join(f"{a}={busbw(row['size'], t[a], W)[1]:8.3f}" for a in ("raw", "flat", "hier"))
    return f"{row['size']:>10d} B  busbw GB/s  {cells}  hier/flat={t['flat'] / t['hier']:5.2f}"


def console_tables(rows: list[dict], W: int) -> str:
    """The report's tables, aligned as plain text."""
    parts = []
    for algo, what in TABLE_ALGOS.items():
        parts += [f"# {algo}: {what}", algo_table(rows, W, algo, markdown=False), ""]
    parts += ["# comparison (busbw ratios)", comparison_table(rows, W, markdown=False)]
    return "\n".join(parts)
