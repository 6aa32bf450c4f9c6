"""Routing traces: the JSON lines equal the counts summed by hand from layer.stats (one process
and 2 gloo ranks, rank 0 writing the sums), the plot tool writes a PNG, bad lines are errors."""

import json
import os
import sys

import pytest
import torch
from torch import nn

import moe
from moe.trace import plot as plot_trace
from tests.distributed import run_ranks

D, F, E = 10, 12, 6


def build(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D, D),
        moe.MoELayer(D, F, E, top_k=2, capacity_factor=0.7, min_capacity=1),
        nn.Linear(D, D),
        moe.MoELayer(D, F, E, top_k=1),
    )


def train_steps(model, trace, steps, seed, tokens=(7, 5)):
    """`steps` steps of two micro-batches (+ an eval forward, not traced); the counts summed
    by hand from layer.stats: per step, per layer (kept, routed, dropped)."""
    g = torch.Generator().manual_seed(seed)
    by_hand = []
    for _ in range(steps):
        sums = {}
        model.train()
        for n in tokens:
            model(torch.randn(n, D, generator=g)).sum().backward()
            for name, layer in moe.moe_layers(model):
                s = layer.stats
                got = [s["tokens_per_expert"], s["routed_per_expert"], s["dropped"]]
                old = sums.get(name)
                sums[name] = got if old is None else [a + b for a, b in zip(old, got)]
        model.eval()
        with torch.no_grad():
            model(torch.randn(3, D, generator=g))
        trace.step()
        by_hand.append({n: [t.tolist() for t in v] for n, v in sums.items()})
    return by_hand


def expected_line(step, name, kept, routed, dropped, ep):
    routed_E = torch.tensor(routed, dtype=torch.float64)
    mean = routed_E.mean()
    return {
        "step": step,
        "layer": name,
        "tokens_per_expert": kept,
        "routed_per_expert": routed,
        "dropped": dropped,
        "load_cv": float(routed_E.std(correction=0) / mean),
        "max_over_mean": float(routed_E.max() / mean),
        "dead_experts": int((routed_E == 0).sum()),
        "ep": ep,
        "rank_load": [int(b.sum()) for b in routed_E.chunk(ep)],
    }


def check(lines, by_hand, ep):
    assert len(lines) == 2 * len(by_hand)
    for i, step in enumerate(by_hand):
        for j, (name, (kept, routed, dropped)) in enumerate(step.items()):
            want = expected_line(i + 1, name, kept, routed, dropped, ep)
            got = lines[2 * i + j]
            assert got.keys() == want.keys()
            for key, value in want.items():
                if isinstance(value, str):  # approx of a string is a TypeError since pytest 9.2
                    assert got[key] == value, key
                else:
                    assert got[key] == pytest.approx(value, rel=1e-12), key


def test_trace_equals_layer_stats_by_hand(tmp_path):
    model = build()
    path = tmp_path / "trace.jsonl"
    trace = moe.RoutingTrace(model, path, every=2)
    by_hand = train_steps(model, trace, 1, seed=1)
    assert path.read_text() == ""  # buffered on the device until the log interval
    by_hand += train_steps(model, trace, 4, seed=2)
    assert len(path.read_text().splitlines()) == 8
    trace.close()  # writes step 5
    lines = moe.read_trace(path)
    check(lines, by_hand, ep=1)
    assert any(line["dropped"] > 0 for line in lines)
    assert not model[1]._forward_hooks  # close removed the hooks
    # resumed from a checkpoint at step 3: later lines go, the new step 4 follows
    with moe.RoutingTrace(model, path, resume_from=3) as again:
        assert moe.read_trace(path) == lines[:6]
        again_by_hand = train_steps(model, again, 1, seed=5)
        again.step()  # a step with no forward: zeros
    resumed = moe.read_trace(path)
    check(resumed[:8], by_hand[:3] + again_by_hand, ep=1)
    assert resumed[8]["step"] == 5 and resumed[8]["routed_per_expert"] == [0] * E


def test_no_host_read_between_log_intervals(tmp_path, monkeypatch):
    """The forward hook and step() only add device tensors: nothing is read to the host
    before the log interval (every=3: steps 1 and 2 stay buffered)."""
    model = build()
    trace = moe.RoutingTrace(model, tmp_path / "trace.jsonl", every=3)
    train_steps(model, trace, 1, seed=4)
    model.train()
    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name: reads.append(_n))
    for _, layer in trace.layers:
        for hook in layer._forward_hooks.values():
            hook(layer, (), None)  # what a training forward's hook does with layer.stats
    trace.step()
    assert reads == [] and len(trace.buffer) == 2
    monkeypatch.undo()
    trace.close()
    assert len(moe.read_trace(tmp_path / "trace.jsonl")) == 4


def _ranks_body(rank, world, path):
    from moe.parallel import init_mesh, parallelize

    model = parallelize(build(), init_mesh(dp=1, ep=world))
    trace = moe.RoutingTrace(model, path.replace("{rank}", str(rank)), every=2)
    by_hand = train_steps(model, trace, 3, seed=10 + rank, tokens=(4 + 3 * rank, 6))
    trace.close()
    return by_hand


def test_trace_on_two_ranks_writes_the_sums_from_rank_0(tmp_path):
    results = run_ranks(_ranks_body, 2, str(tmp_path / "trace-{rank}.jsonl"), timeout=60)
    summed = [
        {
            name: [
                [a + b for a, b in zip(r0[0], r1[0])],
                [a + b for a, b in zip(r0[1], r1[1])],
                r0[2] + r1[2],
            ]
            for (name, r0), r1 in zip(s0.items(), s1.values())
        }
        for s0, s1 in zip(*results)
    ]
    assert summed != results[0]  # the ranks saw different tokens
    check(moe.read_trace(tmp_path / "trace-0.jsonl"), summed, ep=2)
    assert not (tmp_path / "trace-1.jsonl").exists()  # one writer


def test_plot_tool_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    model = build()
    path = tmp_path / "trace.jsonl"
    with moe.RoutingTrace(model, path) as trace:
        train_steps(model, trace, 3, seed=3)
    out = tmp_path / "load.png"
    assert plot_trace.main([str(path), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from examples.m6 import plots  # the M6 example draws expert_load.png from its trace
    from moe.trace.segments import segments

    drawn = plots.plot_expert_load(segments(path), tmp_path / "m6.png", "t")
    assert drawn.read_bytes()[:4] == b"\x89PNG"
    assert (
        plots.plot_expert_load(segments(tmp_path / "none.jsonl"), tmp_path / "no.png", "t") is None
    )


def test_plot_of_a_thousand_layers_is_bounded_and_writes_the_path_it_prints(tmp_path, capsys):
    """1000 layers x 1 step: at most plot_trace.MAX_LAYERS panels, a figure a few thousand
    pixels tall (was 880 x 176,660 px); an output path without a suffix is written as given
    and printed (was <path>.png written, <path> printed) (issue 41 item 14)."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = tmp_path / "trace.jsonl"
    lines = [expected_line(1, f"layers.{i}.mlp", [3, 1], [4, 1], 1, 2) for i in range(1000)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "load"  # no suffix
    assert plot_trace.main([str(path), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "load.png").exists()
    width, height = Image.open(out).size
    assert width <= 1000 and height <= 6000, (width, height)


def test_plot_panels_line_up_share_one_colour_scale_and_name_every_line(tmp_path):
    """ep = 2 with every step's rank loads equal (as the prototype router gives): the heatmaps
    span the same x extent as the panels below (one colorbar for all), share ONE vmax that
    clips no layer, the EP ranks' lines differ in style and marker with the later drawn on top,
    and every line is named in its panel's legend (issue 42 item 6)."""
    pytest.importorskip("matplotlib")
    g = torch.Generator().manual_seed(42)
    lines = []
    for step in range(1, 8):
        for name, E, hot in (("a", 4, 1), ("b", 6, 30)):  # b's busiest expert: a larger share
            half = torch.randint(1, 9, (E // 2,), generator=g)
            half[step % (E // 2)] += hot
            routed = torch.cat([half, half.roll(step)]).tolist()  # equal rank loads
            lines.append(expected_line(step, name, routed, routed, 0, 2))
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    layers = plot_trace.by_layer(moe.read_trace(path))
    assert all((d["rank_load"][:, 0] == d["rank_load"][:, 1]).all() for d in layers.values())
    fig = plot_trace.figure(layers, "t")
    fig.canvas.draw()  # the layout engine places the axes
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 2
    vmax = {im.norm.vmax for im in images}
    assert vmax == {plot_trace.shared_vmax(layers)}
    assert vmax.pop() >= max(float(im.get_array().max()) for im in images)
    panels = [ax for ax in fig.axes if ax.get_images() or ax.get_lines()]
    assert len(fig.axes) == len(panels) + 1 == 2 * 2 + 3 + 1  # one colorbar in all
    extents = {(round(ax.get_position().x0, 6), round(ax.get_position().x1, 6)) for ax in panels}
    assert len(extents) == 1, extents  # heatmaps and panels below span the same x range
    assert len({ax.get_xlim() for ax in panels}) == 1
    for ax in panels[1:4:2]:  # the rank-share panels
        ranks = [ln for ln in ax.get_lines() if ln.get_label().startswith("EP rank")]
        assert len(ranks) == 2 and ranks[1].get_zorder() > ranks[0].get_zorder()
        styles = {(ln.get_linestyle(), ln.get_marker(), ln.get_linewidth()) for ln in ranks}
        assert len(styles) == 2
        assert "equal at every step" in ax.get_legend().get_title().get_text()
    assert "share of" in fig.axes[-1].get_xlabel() + fig.axes[-1].get_ylabel()  # colorbar
    for ax in (ax for ax in panels if ax.get_lines()):  # every line named in a legend
        names = [ln.get_label() for ln in ax.get_lines()]
        assert not any(n.startswith("_") for n in names), names
        assert [t.get_text() for t in ax.get_legend().get_texts()] == names
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_malformed_trace_lines_are_clear_errors(tmp_path, capsys, monkeypatch):
    good = expected_line(1, "x", [1, 2], [1, 3], 1, 2)
    cases = {
        "{not json": r"bad\.jsonl:2: not JSON",
        "[1, 2]": r"bad\.jsonl:2: expected a JSON object",
        json.dumps({**good, "dropped": "3"}): r"bad\.jsonl:2: field 'dropped' must be int",
        json.dumps({k: v for k, v in good.items() if k != "load_cv"}): "field 'load_cv'",
        json.dumps(
            {**good, "tokens_per_expert": [1]}
        ): r"bad\.jsonl:2: tokens_per_expert and routed",
        json.dumps({**good, "rank_load": [4]}): r"bad\.jsonl:2: rank_load must hold ep=2 values",
        json.dumps({**good, "routed_per_expert": [1, "a"]}): "'routed_per_expert' must hold",
    }
    path = tmp_path / "bad.jsonl"
    for line, message in cases.items():
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=message):
            moe.read_trace(path)
    assert plot_trace.main([str(path), str(tmp_path / "x.png")]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err
    path.write_text(json.dumps(good) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ImportError, match="needs matplotlib"):
        plot_trace.plot_trace(path, tmp_path / "x.png")


def test_rank_load_follows_the_placement():
    """After moe.parallel.rebalance_experts moves experts, an expert's load counts for the
    rank holding its slot, not for its canonical block."""
    from moe.trace.routing_trace import trace_line

    routed = [int(v) for v in torch.randint(1, 50, (8,))]
    slots = [int(v) for v in torch.randperm(8)]
    line = trace_line(3, "layer", routed, routed, 0, 4, slots)
    by_hand = [0] * 4
    for count, slot in zip(routed, slots):
        by_hand[slot // 2] += count
    assert line["rank_load"] == by_hand
    canonical = trace_line(3, "layer", routed, routed, 0, 4)["rank_load"]
    assert canonical == [routed[2 * r] + routed[2 * r + 1] for r in range(4)]


def test_trace_files_are_read_as_untrusted(tmp_path):
    """A FIFO (which would block) and deeply nested JSON (which would exhaust the stack) are
    one clear error each."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO, not a regular file"):
        moe.read_trace(fifo)
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"deep\.jsonl:1: JSON nested 100000 levels deep"):
        moe.read_trace(deep)


def test_hostile_trace_lines_are_one_error_naming_the_line(tmp_path, capsys):
    """NaN, infinities, negative counts, duplicate keys, integers past int64, a huge layer
    name and a layer whose E changes are each refused by read_trace (and so by the plot tool,
    one `error:` line) naming file:line, before any plotting."""
    good = expected_line(1, "x", [1, 2], [1, 3], 1, 2)
    text = json.dumps(good)
    cases = {
        text.replace('"load_cv": 0.5', '"load_cv": NaN'): r"bad\.jsonl:2: not JSON \(NaN",
        text.replace('"load_cv": 0.5', '"load_cv": Infinity'): "not JSON",
        text.replace('"load_cv": 0.5', '"load_cv": 1e400'): "not finite",
        text.replace('"step": 1', f'"step": {10**400}'): "integer of 401 digits",
        json.dumps({**good, "routed_per_expert": [-1, 5]}): "'routed_per_expert' must not be neg",
        json.dumps({**good, "dropped": -2}): "'dropped' must not be negative",
        json.dumps({**good, "step": -1}): "'step' must not be negative",
        text[:-1] + ', "dropped": 4}': r"key 'dropped' appears twice",
        json.dumps({**good, "layer": "L" * (1 << 20)}): "layer name longer than 1024",
        json.dumps({**good, "dead_experts": 3}): "dead_experts 3 > E=2",
        json.dumps(expected_line(2, "x", [1, 2, 3, 4], [1, 3, 0, 0], 1, 2)): (
            r"bad\.jsonl:2: layer 'x' has E=4, ep=2 here and E=2, ep=2 above"
        ),
    }
    rebalance = {"kind": "rebalance", "step": 1, "layer": "x", "ep": 2,
                 "copies_per_expert": [2, 1], "max_over_mean_before": 1.5,
                 "max_over_mean_after": 1.0, "slots_moved": 1, "call_bytes_sent": 10}  # fmt: skip
    reb = json.dumps(rebalance)
    cases.update({
        reb.replace('"max_over_mean_after": 1.0', '"max_over_mean_after": NaN'): "not JSON",
        json.dumps({**rebalance, "slots_moved": -1}): "'slots_moved' must not be negative",
        json.dumps({**rebalance, "call_bytes_sent": 10**30}): "integer of 31 digits",
        reb[:-1] + ', "step": 2}': r"key 'step' appears twice",
        json.dumps({**rebalance, "copies_per_expert": [3, 1]}): "integers from 1 to ep=2",
        json.dumps({**rebalance, "copies_per_expert": [1] * 4}): "layer 'x' has E=4",
        json.dumps({**rebalance, "layer": "L" * (1 << 20)}): "layer name longer than 1024",
        json.dumps({**rebalance, "extra": [0] * 5}): "unknown field 'extra'",
        json.dumps({**rebalance, "kind": "other"}): "unknown record kind 'other'",
        json.dumps({**rebalance, "ep": True}): "'ep' must be int",
    })  # fmt: skip
    assert '"load_cv": 0.5' in text and '"step": 1,' in text
    path = tmp_path / "bad.jsonl"
    for line, message in cases.items():
        path.write_text(text + "\n" + line + "\n")
        with pytest.raises(ValueError, match=message):
            moe.read_trace(path)
        assert plot_trace.main([str(path), str(tmp_path / "x.png")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}:2: ") and err.count("\n") == 1, err[:300]
    assert not (tmp_path / "x.png").exists()
    other = expected_line(1, "y", [1, 2, 3, 4], [1, 3, 0, 0], 1, 2)  # another layer's E: fine
    path.write_text(text + "\n" + json.dumps(other) + "\n" + reb + "\n")
    assert moe.read_trace(path)[2] == rebalance


@pytest.mark.parametrize("kind", ["fifo", "directory", "damaged"])
def test_trace_path_problems_are_errors_before_writing(kind, tmp_path):
    path = tmp_path / "trace.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
        message = "not a regular file"
    elif kind == "directory":
        path.mkdir()
        message = "not a regular file"
    else:
        path.write_text(json.dumps(expected_line(1, "0", [1, 2], [1, 3], 1, 1)) + "\n{x\n")
        message = r"trace\.jsonl:2: not JSON"
    model = build()
    with pytest.raises(ValueError, match=message):
        moe.RoutingTrace(model, path, resume_from=1)
    assert all(not layer._forward_hooks for _, layer in moe.moe_layers(model))  # none left
    if kind == "damaged":
        assert path.read_text().endswith("{x\n")  # untouched


def _damaged_body(rank, world, path):
    from moe.parallel import init_mesh, parallelize

    model = parallelize(build(), init_mesh(dp=1, ep=world))
    with pytest.raises(ValueError, match=r"trace\.jsonl:1: not JSON") as e:
        moe.RoutingTrace(model, path, resume_from=3)
    return str(e.value)


def test_a_damaged_trace_is_the_same_error_on_every_rank(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("{damaged\n")
    errors = run_ranks(_damaged_body, 2, str(path), timeout=30)
    assert errors[0] == errors[1]
