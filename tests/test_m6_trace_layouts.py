"""A run resumed at another (dp, ep) layout finishes with its plots and report (issue 49
item 7): the routing trace is kept as one file per layout (moe/trace/segments.py) and
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
    from moe.trace.segments import segments  # (after the run: base 7b9a55a fails above)

    files = segments(tmp_path / "routing_trace.jsonl")
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
    assert [_eps(f) for f in segments(tmp_path / "routing_trace.jsonl")] == [[1], [2], [1], [2]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 11 and summary["ep"] == 2


def _rebalancing(rank, world_size, run_dir):
    argv = ["--steps", "8", "--eval-every", "1000", "--global-batch", "16", "--log-every", "8",
            "--rebalance-every", "4", "--run-dir", run_dir, "--ep", "2", "--quiet"]  # fmt: skip
    return train.run(argv).get("plots")


def test_steps_before_a_rebalance_keep_the_placement_they_ran_on(tmp_path):
    """Issue 49 item 18: the trace's rank loads of the steps before a rebalance are those of
    the placement they ran on (m6-tiny's prototype router: exactly half on each of 2 EP ranks
    while experts 0-3 and 4-7 sit on ranks 0 and 1), not the placement the rebalance made;
    the rebalance is marked in expert_load.png."""
    plots = run_ranks(_rebalancing, 2, str(tmp_path), timeout=300)[0]
    assert str(tmp_path / "expert_load.png") in plots
    lines = [json.loads(x) for x in (tmp_path / "routing_trace.jsonl").read_text().splitlines()]
    moved = [r for r in lines if r.get("kind") == "rebalance" and r["step"] == 4]
    assert moved and any(r["slots_moved"] for r in moved), moved
    for r in lines:
        if "kind" not in r and r["step"] <= 4:
            assert r["rank_load"][0] == r["rank_load"][1], r  # one prototype per rank


def test_expert_load_marks_rebalances_and_layout_changes(tmp_path, monkeypatch):
    from examples.m6 import plots

    def line(step, ep, rank_load):
        return {"step": step, "layer": "blocks.1.ffn", "tokens_per_expert": [3, 1, 2, 2],
                "routed_per_expert": [3, 1, 2, 2], "dropped": 0, "load_cv": 0.3,
                "max_over_mean": 1.5, "dead_experts": 0, "ep": ep, "rank_load": rank_load}  # fmt: skip

    rebalance = {"kind": "rebalance", "step": 2, "layer": "blocks.1.ffn", "ep": 1,
                 "copies_per_expert": [1, 1, 1, 1], "max_over_mean_before": 1.08,
                 "max_over_mean_after": 1.0, "slots_moved": 2, "call_bytes_sent": 10}  # fmt: skip
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(
        "".join(json.dumps(r) + "\n" for r in [line(1, 1, [8]), line(2, 1, [8]), rebalance])
    )
    b.write_text("".join(json.dumps(line(s, 2, [5, 3])) + "\n" for s in (3, 4)))
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    plots.plot_expert_load([a, b], tmp_path / "e.png", "t\nsettings here")
    fig = figures[0]
    heat, ranks, *metrics = fig.axes[:5]
    xs = {round(x, 1) for ln in ranks.lines if ln.get_linestyle() == ":" for x in ln.get_xdata()}
    assert 2.5 in xs  # the rebalance after step 2
    assert any(t.get_text() == "1.08->1.00" for t in ranks.texts)
    labels = {t.get_text() for t in metrics[0].get_legend().get_texts()}
    assert any(x.startswith("expert rebalance") for x in labels), labels
    assert "resumed at ep=2 (was 1)" in labels
    assert "settings here" in fig._suptitle.get_text()


def test_a_trace_mixing_layouts_from_an_earlier_release_is_split_on_resume(tmp_path):
    """A routing_trace.jsonl written before the split (ep=1 then ep=2 lines in one file, which
    read_trace refuses) is split into per-layout files on the next resume; lines past the
    resume step are dropped; a damaged line stays one ValueError naming file:line."""
    import pytest

    from moe.trace.segments import prepare_resume, segments

    def line(step, ep):
        return {"step": step, "layer": "b.ffn", "tokens_per_expert": [1, 1],
                "routed_per_expert": [1, 1], "dropped": 0, "load_cv": 0.0,
                "max_over_mean": 1.0, "dead_experts": 0, "ep": ep, "rank_load": [2 // ep] * ep}  # fmt: skip

    lines = [line(1, 1), line(2, 1), line(3, 2), line(4, 2), line(5, 2)]
    (tmp_path / "routing_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    trace = tmp_path / "routing_trace.jsonl"
    prepare_resume(trace, 4, 1)  # resumed at step 4 on one process
    assert [f.name for f in segments(trace)] == [
        "routing_trace.steps-1-2.jsonl", "routing_trace.steps-3-4.jsonl", "routing_trace.jsonl"
    ]  # fmt: skip
    assert (tmp_path / "routing_trace.jsonl").read_text() == ""
    (tmp_path / "routing_trace.jsonl").write_text(json.dumps(line(5, 1)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"routing_trace.jsonl:2: "):
        prepare_resume(trace, 5, 1)


def _pp_run(rank, world_size, run_dir, extra):
    summary = train.run([*RUN, "--run-dir", run_dir, "--quiet", *extra])
    return summary.get("plots"), summary["steps"]


def test_a_pp_run_resumed_without_pp_plots_every_step(tmp_path, monkeypatch):
    """--pp 2 for steps 1-3 (its stage traces), resumed at --ep 2 for 4-6: expert_load.png
    draws steps 1-6 (the stage traces were left out: steps 4-6 only), each step once per
    layer; the stage traces keep their lines up to the checkpoint, none after it."""
    from examples.m6 import plots, report

    run_dir = str(tmp_path)
    out = run_ranks(_pp_run, 2, run_dir, ["--pp", "2", "--stop-after", "3"], timeout=300)
    assert out[0][1] == 3
    stage = tmp_path / "routing_trace.stage-0.jsonl"
    assert _steps(stage) == [1, 2, 3]
    stale = json.loads(stage.read_text().splitlines()[-1])
    with stage.open("a") as f:  # a line past the checkpoint (a run that went on, then died)
        f.write(json.dumps({**stale, "step": 4}) + "\n")
    run_ranks(_pp_run, 2, run_dir, ["--ep", "2", "--resume", "--stop-after", "6"], timeout=300)
    names = [p.name for p in tmp_path.glob("routing_trace*.jsonl")]
    lines = [json.loads(x) for n in names for x in (tmp_path / n).read_text().splitlines()]
    per_layer = {}
    for r in lines:
        per_layer.setdefault(r["layer"], []).append(r["step"])
    assert per_layer and all(sorted(s) == [1, 2, 3, 4, 5, 6] for s in per_layer.values())
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    monkeypatch.setattr(plots, "plot_loss", lambda *args: None)
    report.make_plots({"title": "t"}, None, {"pp": 1, "samples": []}, tmp_path)
    drawn = [ln for ax in figures[0].axes for ln in ax.lines if ln.get_label() in per_layer]
    assert drawn  # the metric panels: one line per layer over every step
    assert all(list(ln.get_xdata()) == [1, 2, 3, 4, 5, 6] for ln in drawn)
