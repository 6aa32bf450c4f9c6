"""A run resumed at another (dp, ep) layout finishes with its plots and report (issue 49
item 7): the routing trace is kept as one file per layout (examples/m6/trace_files.py) and
expert_load.png draws them all, in both directions (1 process -> ep=2 -> 1 process)."""

import json

from examples.m6 import train
from tests.distributed import run_ranks

RUN = ["--steps", "9", "--eval-every", "1000", "--global-batch", "16", "--log-every", "1"]


def _two_ranks(rank, world_size, run_dir, extra):
    summary = train.run([*RUN, "--run-dir", run_dir, "--ep", "2", "--quiet", *extra])
    return summary.get("plots"), summary["steps"]


def _eps(path):
    return sorted({json.loads(line)["ep"] for line in path.read_text().splitlines()})


def _steps(path):
    return sorted({json.loads(line)["step"] for line in path.read_text().splitlines()})


def test_resume_at_another_layout_keeps_the_trace_and_plots_it(tmp_path):
    run_dir = str(tmp_path)
    train.run([*RUN, "--run-dir", run_dir, "--quiet", "--stop-after", "3"])  # 1 process, ep=1
    plots, steps = run_ranks(_two_ranks, 2, run_dir, ["--resume", "--stop-after", "6"],
                             timeout=300)[0]  # fmt: skip
    assert steps == 6 and plots is None  # stopped early on purpose: no report yet
    summary = train.run([*RUN, "--run-dir", run_dir, "--quiet", "--resume"])  # back to ep=1
    assert summary["steps"] == 9
    assert (tmp_path / "expert_load.png").stat().st_size > 0
    assert str(tmp_path / "expert_load.png") in summary["plots"]
    from examples.m6.trace_files import segments  # (after the run: base 7b9a55a fails above)

    files = segments(tmp_path)
    assert [f.name for f in files] == [
        "routing_trace.steps-1-3.jsonl",
        "routing_trace.steps-4-6.jsonl",
        "routing_trace.jsonl",
    ]
    assert [_eps(f) for f in files] == [[1], [2], [1]]
    assert [_steps(f) for f in files] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    # and 1 -> 2 at the end: the report is drawn by rank 0 of the ep=2 run
    plots, steps = run_ranks(_two_ranks, 2, run_dir, ["--resume", "--steps", "11"],
                             timeout=300)[0]  # fmt: skip
    assert steps == 11 and str(tmp_path / "expert_load.png") in plots
    assert [_eps(f) for f in segments(tmp_path)] == [[1], [2], [1], [2]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 11 and summary["ep"] == 2
