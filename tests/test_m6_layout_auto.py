"""M6 `--layout auto` (issue 48 item 3): the example asks moe.plan for the top layout of its
config on the launched world and trains with it: on 2 and 4 gloo ranks (the h100 preset with
--device-memory-gb small enough that pipelines, optimizer groups or recompute win) the run's
(pp, dp, ep) and flags are the planner's first (at 4 ranks and 0.005 GiB: pp 2 with
recompute); explicit layout flags with it, --cluster without it and a bad
cluster file are one `error:` line before any work."""

import json
from dataclasses import fields

import pytest

from examples.m6 import train
from examples.m6.auto_layout import ranked
from examples.m6.config import get_config
from moe.plan import preset
from moe.plan.layout import Layout
from tests.distributed import run_ranks

# no final evaluation: 2 of 3 steps, then the checkpoint
FAST = ["--quiet", "--no-plots", "--steps", "3", "--stop-after", "2", "--layout", "auto"]
RUNS = {2: [None, 0.006], 4: [0.005]}  # --device-memory-gb per world (None: the preset's 80)


def _top(world: int, memory: float | None) -> str:
    changes = {} if memory is None else {"device_memory_gib": memory}
    cluster = preset("h100", nodes=1, gpus_per_node=world, **changes)
    return ranked(get_config("m6-tiny"), world, 64, cluster)[0].layout


def _ranks(rank, world, root):
    out = []
    for memory in RUNS[world]:
        extra = [] if memory is None else ["--device-memory-gb", str(memory)]
        s = train.run(["--run-dir", f"{root}/m{memory}", *FAST, *extra])
        keys = ("layout", "pp", "dp", "ep", "losses", "settings", "run_layout")
        out.append({k: s[k] for k in keys})
    return out


@pytest.mark.parametrize("world", sorted(RUNS))
def test_the_planners_top_layout_trains(world, tmp_path):
    ranks = run_ranks(_ranks, world, str(tmp_path), timeout=240)
    for r in ranks[1:]:
        assert r == ranks[0]
    for memory, got in zip(RUNS[world], ranks[0]):
        top = _top(world, memory)
        assert got["layout"] == top.short(), (memory, got["layout"], top.short())
        ran = Layout(**got["run_layout"])  # what the run built, read from its objects
        differ = [
            (f.name, getattr(top, f.name), getattr(ran, f.name))
            for f in fields(Layout)
            if getattr(top, f.name) != getattr(ran, f.name)
        ]
        assert not differ, (memory, differ)  # e.g. the capacity factor: the plan's is the run's
        assert (got["pp"], got["dp"], got["ep"]) == (top.pp, top.dp, top.ep)
        assert len(got["losses"]) == 2 and all(0 < x < 10 for x in got["losses"])
        assert ("activation checkpointing" in got["settings"]) == (top.recompute == "full")
        if top.pp > 1:
            assert f"pipeline pp {top.pp} ({world} ranks), {top.schedule}" in got["settings"]
    if world == 2:  # pipelines (pp = 1 syncs gradients every micro-batch); the small memory
        # moves the choice to a schedule with fewer micro-batches in flight
        assert ranks[0][0]["pp"] == ranks[0][1]["pp"] == 2
        assert "GPipe" in ranks[0][0]["layout"] and "1F1B" in ranks[0][1]["layout"], ranks[0]
    else:
        assert ranks[0][0]["pp"] == 2 and "activation checkpointing" in ranks[0][0]["settings"]


def test_one_process_says_why_and_reads_a_cluster_file(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    preset("h200").save(path)
    train.run(["--run-dir", str(tmp_path / "run"), *FAST[1:], "--cluster", str(path)])
    out = capsys.readouterr().out
    assert "layout auto on 1 x h200 (141 GiB): pp1 dp1 ep1" in out, out
    assert "predicted " in out and "runner-up: " in out, out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layout", "auto", "--ep", "2"], "--layout auto sets the layout; drop --ep"),
        (["--layout", "auto", "--micro-batch=4", "--pp", "2"], "drop --pp, --micro-batch"),
        (["--cluster", "c.json"], "--cluster needs --layout auto"),
        (["--layout", "auto", "--cluster", "BAD"], "not a moe.plan cluster file"),
        (
            ["--layout", "auto", "--device-memory-gb", "1e-6"],
            "--layout auto: m6-tiny fits no layout on 1 x 1",
        ),
    ],
)
def test_bad_layout_flags_are_one_error_line(argv, message, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": -1}))
    argv = [str(bad) if a == "BAD" else a for a in argv]
    assert train.main(["--run-dir", str(tmp_path / "run"), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_ranked_is_fastest_first():
    preds = ranked(get_config("m6-tiny"), 4, 64, preset("h100", gpus_per_node=4))
    times = [p.step_time for p in preds]
    assert times == sorted(times) and len(preds) > 1
