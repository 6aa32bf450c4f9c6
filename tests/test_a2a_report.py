"""The all-to-all report says what the run was: its ranks, cores and layout computed from the
run, the hierarchical ratios n/a on one node, no busbw rounded to 0, the PNG drawing the
console's columns; and every command-line flag of the benches and examples has help text."""

import argparse

import pytest

from bench.a2a.report import write_report
from bench.a2a.runner import ALGOS, default_ranks_per_node
from bench.a2a.tables import PLOTTED, console_line

pytest.importorskip("matplotlib")


def _result(W: int, L: int) -> dict:
    rows = [
        {"size": size, "count": size // (4 * W), "chunks": 1,
         "time_us": {a: 900.0 + 37 * i + size / 100 for i, a in enumerate(ALGOS)}}
        for size in (1024, 2048, 1 << 20)
    ]  # fmt: skip
    meta = {"world_size": W, "ranks_per_node": L, "uneven": False, "backend": "gloo"}
    return {"meta": meta, "rows": rows}


def test_report_is_computed_from_the_run(tmp_path):
    results = {"loopback 4 ranks, even": _result(4, 4), "loopback 6 ranks, even": _result(6, 3)}
    cfg = {"min_bytes": 1024, "max_bytes": 1 << 20, "factor": 2}
    path = tmp_path / "r.md"
    write_report(path, results, {n: cfg for n in results}, "python -m bench.alltoall --nproc 4")
    text = path.read_text()
    assert "8 ranks" not in text and "4, 6 ranks" in text
    one_node, two_nodes = text.split("## loopback 6 ranks, even")
    assert "n/a (1 node)" in one_node and "n/a" not in two_nodes.split("## What")[0]
    assert "| 0.000 |" not in text and " 0.0000 " not in text
    assert (tmp_path / "r-loopback-4-ranks.png").stat().st_size > 0
    assert (tmp_path / "r-loopback-6-ranks.png").stat().st_size > 0
    line = console_line(_result(4, 4)["rows"][0], 4, 4)
    assert all(f"{a}=" in line for a in PLOTTED) and "hier n/a (1 node)" in line
    assert "0.000 " not in line
    assert default_ranks_per_node(4) == 2 and default_ranks_per_node(8) == 4
    assert default_ranks_per_node(3) == 3


def _parser(parse_args) -> argparse.ArgumentParser:
    """The ArgumentParser a parse_args(argv) function builds (captured, nothing run)."""
    seen = []
    real = argparse.ArgumentParser.parse_args

    def capture(self, *a, **k):
        seen.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = real
    return seen[0]


def test_every_flag_has_help_text():
    from bench.alltoall import parse_args as a2a_args
    from examples.m6.cli import parse_args as m6_args

    for parse_args in (a2a_args, m6_args):
        parser = _parser(parse_args)
        missing = [
            a.option_strings[0]
            for a in parser._actions
            if a.option_strings and not a.help and a.dest != "help"
        ]
        assert missing == [], missing
