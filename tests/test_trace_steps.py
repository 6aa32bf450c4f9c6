"""RoutingTrace refuses what read_trace would reject (issue 41 item 10): a negative or
non-integer step, a rebalance record for a negative step, another model's report or None;
what it accepts reads back."""

import pytest
import torch

import moe
from moe.parallel.rebalance import RebalanceReport
from moe.slots.placement import choose_placement
from moe.trace.routing_trace import RoutingTrace, read_trace


def test_bad_steps_and_foreign_reports_are_clear_errors(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(moe.MoELayer(8, 16, 4, spare_slots=2))
    path = tmp_path / "trace.jsonl"
    trace = RoutingTrace(model, path, every=1)
    model(torch.randn(10, 8))
    for bad in (-3, 2.5, True, "1"):
        with pytest.raises(ValueError, match=r"RoutingTrace.step: step must be an int >= 0"):
            trace.step(bad)
    trace.step(0)
    mine = RebalanceReport(layers={"0": choose_placement([5.0, 1, 1, 1], [0, 1, 2, 3], 2, 0.0)})
    other = RebalanceReport(layers={"ffn": choose_placement([5.0, 1], [0, 1], 2, 0.0)})
    with pytest.raises(ValueError, match="record_rebalance: step must be an int >= 0, got -1"):
        trace.record_rebalance(-1, mine)
    with pytest.raises(ValueError, match="expected the RebalanceReport .* got NoneType"):
        trace.record_rebalance(1, None)
    with pytest.raises(ValueError, match="layer 'ffn' \\(2 experts\\) is not a layer of the"):
        trace.record_rebalance(1, other)
    trace.record_rebalance(1, mine)
    trace.close()
    records = read_trace(path)
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["kind"] == "rebalance" and records[1]["layer"] == "0"
    assert sum(records[0]["routed_per_expert"]) == 10 * 2  # top-2 of 10 tokens


def test_a_trace_resumed_at_another_ep_keeps_one_layout_per_file(tmp_path):
    """Issue 49 item 7, in the library: a RoutingTrace resumed at another EP size (here: lines
    written at ep=2, resumed in one process) moves the earlier layout's lines into a file of
    their own, so every file reads back (read_trace refuses a layout change within one file,
    which the resumed run used to append); moe.trace.segments lists them in step order."""
    import json

    from moe.trace.segments import segments

    torch.manual_seed(0)
    model = torch.nn.Sequential(moe.MoELayer(8, 16, 4))
    path = tmp_path / "trace.jsonl"
    trace = RoutingTrace(model, path, every=1)
    for _ in range(3):
        model(torch.randn(6, 8))
        trace.step()
    trace.close()
    lines = read_trace(path)  # rewritten as if recorded at ep=2 (two ranks of 2 experts)
    for r in lines:
        r["ep"], r["rank_load"] = (
            2,
            [sum(r["routed_per_expert"][:2]), sum(r["routed_per_expert"][2:])],
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    trace = RoutingTrace(model, path, every=1, resume_from=2)  # one process: ep=1
    model(torch.randn(6, 8))
    trace.step()
    trace.close()
    files = segments(path)
    assert [f.name for f in files] == ["trace.steps-1-2.jsonl", "trace.jsonl"]
    parts = [read_trace(f) for f in files]
    assert [[r["step"] for r in part] for part in parts] == [[1, 2], [3]]
    assert [{r["ep"] for r in part} for part in parts] == [{2}, {1}]
