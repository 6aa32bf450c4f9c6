"""RoutingTrace refuses what read_trace would reject (issue 41 item 10): a negative or
non-integer step, a rebalance record for a negative step, another model's report or None;
what it accepts reads back."""

import pytest
import torch

import moe
from moe.parallel.rebalance import RebalanceReport
from moe.slots.placement_plan import plan_placement
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
    mine = RebalanceReport(layers={"0": plan_placement([5.0, 1, 1, 1], [0, 1, 2, 3], 2, 0.0)})
    other = RebalanceReport(layers={"ffn": plan_placement([5.0, 1], [0, 1], 2, 0.0)})
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
