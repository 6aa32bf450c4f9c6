"""bench.pipeline end to end at a tiny size on loopback (2 ranks, GPipe and ZBVZeroBubble): the
JSON / markdown / PNG it writes, bubbles in [0, 1] and recomputable from the raw per-rank
records, the busy clock seeing forwards, backwards and (split backward only) weight
backwards, the stages' parameters adding up to the model's; the theoretical bubbles against
hand-computed values. No timing asserts."""

import json
import statistics
from fractions import Fraction

import pytest

from bench.pipeline import main, parse_args, rerun_command
from bench.pipeline_bench.report import main as report_main
from bench.pipeline_bench.theory import theoretical_bubble
from bench.pipeline_bench.worker import BusyClock, build_model, stage_plan, stages_per_rank

pytest.importorskip("matplotlib")

TINY = dict(blocks=4, d_model=16, d_ff=32, experts=4, top_k=2, vocab=32)


@pytest.mark.parametrize(
    "schedule, p, m, v, want",
    [
        ("GPipe", 2, 4, 1, Fraction(1, 5)),
        ("1F1B", 4, 8, 1, Fraction(3, 11)),
        ("1F1B", 4, 4, 1, Fraction(3, 7)),
        ("Interleaved1F1B", 4, 8, 2, Fraction(3, 19)),
        ("Interleaved1F1B", 2, 4, 3, Fraction(1, 13)),
        ("InterleavedZeroBubble", 2, 4, 2, Fraction(1, 25)),
        ("ZBVZeroBubble", 4, 8, 2, Fraction(0)),
        ("DualPipeV", 4, 8, 2, Fraction(3, 27)),
        ("DualPipeV", 2, 4, 2, Fraction(1, 13)),
    ],
)
def test_theoretical_bubble_against_hand_computed(schedule, p, m, v, want):
    got = theoretical_bubble(schedule, p, m, v)
    assert got.value == pytest.approx(float(want), abs=1e-15)
    assert got.formula and "arXiv" in got.source


def test_theoretical_bubble_refuses_bad_values():
    with pytest.raises(ValueError, match="m must be an int >= 1"):
        theoretical_bubble("GPipe", 2, 0)
    with pytest.raises(ValueError, match="GPipe runs one stage per rank"):
        theoretical_bubble("GPipe", 2, 4, 2)
    with pytest.raises(ValueError, match="ZBVZeroBubble runs two stages per rank"):
        theoretical_bubble("ZBVZeroBubble", 2, 4, 1)
    with pytest.raises(ValueError, match="unknown schedule 'ZB'"):
        theoretical_bubble("ZB", 2, 4)


def test_stage_plan_and_stages_per_rank():
    assert stage_plan(4, 2) == [["embed", "b0", "b1"], ["b2", "b3", "head"]]
    assert stage_plan(4, 4) == [["embed", "b0"], ["b1"], ["b2"], ["b3", "head"]]
    with pytest.raises(ValueError, match="4 blocks do not split evenly into 3 stages"):
        stage_plan(4, 3)
    assert [stages_per_rank(s) for s in ("GPipe", "1F1B", "Interleaved1F1B", "DualPipeV")] == [
        1,
        1,
        2,
        2,
    ]


def test_busy_clock_counts_nested_calls_once():
    clock = BusyClock()
    inner = clock.wrap("forward", lambda: sum(range(20000)))
    outer = clock.wrap("backward", lambda: [inner() for _ in range(3)])
    outer()
    assert clock.seconds["backward"] > 0 and clock.seconds["forward"] == 0
    inner()
    assert clock.seconds["forward"] > 0
    clock.reset()
    assert set(clock.seconds.values()) == {0.0}


def test_rerun_command_leaves_out_the_note():
    argv = ["--ep2", "--note", "loaded machine", "--out", "a b", "--note=x"]
    assert rerun_command(argv) == "python -m bench.pipeline --ep2 --out 'a b'"


def test_every_flag_has_help_text():
    import argparse

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
    missing = [
        a.option_strings[0]
        for a in seen[0]._actions
        if a.option_strings and not a.help and a.dest != "help"
    ]
    assert missing == []


def test_benchmark_end_to_end_on_loopback(tmp_path):
    flags = {f"--{k.replace('_', '-')}": str(v) for k, v in TINY.items()}
    argv = [*(x for kv in flags.items() for x in kv), "--loopback", "--pp", "2"]
    argv += ["--microbatches", "2", "--schedules", "GPipe,ZBVZeroBubble,DualPipeV"]
    argv += ["--seq", "4", "--microbatch-rows", "1", "--steps", "2", "--warmup", "1"]
    argv += ["--out", str(tmp_path / "r")]
    assert main(argv) == 0
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["meta"]["network"] == "loopback" and out["meta"]["loopback_reason"] == "--loopback"
    table = out["table"]
    assert [(r["schedule"], r["microbatches"]) for r in table] == [
        ("GPipe", 2),
        ("ZBVZeroBubble", 2),
    ]
    (layout,) = out["layouts"]
    assert layout["skipped"] == [
        {
            "schedule": "DualPipeV",
            "microbatches": 2,
            "reason": "PipelineConfig.microbatches=2: DualPipeV needs at least 4 micro-batches "
            "at pp=2",
        }
    ]
    model_bytes = sum(p.nbytes for p in build_model({**TINY}).parameters())
    for row in table:
        v = row["stages_per_rank"]
        assert row["theory"] == theoretical_bubble(row["schedule"], 2, 2, v).value
        assert len(row["bubble"]) == 2 and all(0.0 <= b <= 1.0 for b in row["bubble"])
        assert row["bubble_mean"] == pytest.approx(statistics.fmean(row["bubble"]))
        assert row["step_ms"] > 0 and all(b > 0 for b in row["busy_ms"])
        # from the raw records (CPU time over wall time has no bound on a loaded machine)
        mine = [r for r in layout["rows"] if r["schedule"] == row["schedule"]]
        fwd = sum(r["busy_parts_s"]["forward"] for r in mine)
        bwd = sum(r["busy_parts_s"]["backward"] + r["busy_parts_s"]["weight"] for r in mine)
        assert len(mine) == 2 and row["backward_over_forward"] == pytest.approx(bwd / fwd)
        cpu = statistics.fmean(sum(r["busy_cpu_s"]) / sum(r["busy_s"]) for r in mine)
        assert row["busy_on_cpu"] == pytest.approx(cpu)
        assert row["step_vs_1f1b"] is None and row["work_vs_1f1b"] is None  # no 1F1B row here
        assert all(p > 0 for p in row["step_peak_mib"])
        assert sum(row["param_mib"]) * 2**20 == model_bytes  # each parameter on one stage
    ranks = {(r["schedule"], r["rank"]): r for r in layout["rows"]}
    for (schedule, _), r in ranks.items():
        # the bubble from the raw records: 1 - busy / the slowest rank's step, median
        want = statistics.median(
            max(0.0, 1 - b / s) for b, s in zip(r["busy_s"], r["step_s"], strict=True)
        )
        assert r["bubble"] == pytest.approx(want)
        assert r["step_s"] == [
            max(x) for x in zip(*(ranks[(schedule, k)]["wall_s"] for k in (0, 1)))
        ]
        parts = r["busy_parts_s"]
        assert parts["forward"] > 0 and parts["backward"] > 0
        # only the split-backward schedule runs weight backwards
        assert (parts["weight"] > 0) == (schedule == "ZBVZeroBubble")
    # the V schedule: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert ranks[("ZBVZeroBubble", 0)]["stages"] == [["embed", "b0"], ["b3", "head"]]
    assert ranks[("ZBVZeroBubble", 1)]["stage_indices"] == [1, 2]
    assert ranks[("GPipe", 1)]["stages"] == [["b2", "b3", "head"]]
    assert ranks[("ZBVZeroBubble", 1)]["stages"] == [["b1"], ["b2"]]
    md = (tmp_path / "r.md").read_text()
    header = "| pp | ep | schedule | m | v | step ms | step / 1F1B | work / 1F1B | measured bubble"
    assert header in md
    assert md.count("\n| 2 | 1 | ") == 2 and "| 2 | 1 | ZBVZeroBubble | 2 | 2 |" in md
    assert md.count(" | n/a | n/a | ") == 2  # step and work / 1F1B without a 1F1B row
    assert "DualPipeV m=2: PipelineConfig.microbatches=2" in md
    assert "python -m bench.pipeline --" in md and "![bubbles and step times](r.png)" in md
    assert (tmp_path / "r.png").stat().st_size > 0
    # the report written again from the JSON alone is the same
    (tmp_path / "r.md").unlink()
    report_main([str(tmp_path / "r.json")])
    assert (tmp_path / "r.md").read_text() == md
