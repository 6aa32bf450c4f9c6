"""The FP8 benchmarks' plumbing (issue 40): the memory replay's FP8 kinds keep fewer bytes for
the backward than the same GEMMs keeping their high-precision inputs, the emulated-network step
ops run on gloo ranks, and the reports of bench.fp8_step and bench.m6_fp8 say what they compare."""

import argparse
import os

import pytest
import torch

from bench import fp8_step, m6_fp8
from bench import memory_replay as replay
from tests.distributed import run_ranks

SHAPE = (64, 96, 4, 2, 80)  # T, d, E, k, F: widths past the 4-byte row scales


def _saved(kind: str) -> int:
    module, x = replay.build(kind, *SHAPE, torch.bfloat16)
    return replay.saved_bytes(lambda: module(x), [x, *module.parameters()])[0]


T_, D_, _, K_, F_ = SHAPE


@pytest.mark.parametrize(
    "kinds, diff",
    [
        # the titan-style chain, per routed row: the down-projection's input in 1 byte + a
        # 4-byte scale instead of 2 bytes, less the 4-byte scales of the two quantized copies
        # of x (up and gate quantize x each)
        (("titan-fp8", "titan-fp8-hp"), T_ * K_ * (2 * F_ - (F_ + 4) - 2 * 4)),
        # moe's FP8 expert MLP keeps x once per token: as e4m3 + a 4-byte scale, or (hp) the
        # layer's own input, which the layer keeps anyway (the router's input): no bytes of its
        # own; and with save_fp8 the down-projection's e4m3 input per routed row + its scale
        # (hp: recomputed from h, g)
        (("fp8", "fp8-hp"), -T_ * (D_ + 4) - T_ * K_ * (F_ + 4)),
    ],
)
def test_replay_fp8_kinds_keep_quantized_inputs(kinds, diff):
    fp8, hp = (_saved(kind) for kind in kinds)
    assert hp - fp8 == diff, (hp, fp8)


def _step_ops(rank, world_size):
    cfg = {"d_model": 128, "d_ff": 64, "experts": 4, "tokens": 16, "top_k": 2}
    ops = fp8_step._ops(cfg, rank, world_size)
    return sorted(ops) == sorted(fp8_step.VARIANTS) and all(
        isinstance(op(), float) for op in ops.values()
    )


def test_fp8_step_ops_run_on_two_ranks():
    assert run_ranks(_step_ops, 2, timeout=120) == [True, True]


def test_fp8_step_report_names_the_variants(tmp_path):
    a = fp8_step.parse_args([])
    ms = {v: 100.0 + i for i, v in enumerate(fp8_step.VARIANTS)}
    rows = [{"rate_mbit": 100, "median_ms": ms, "median_fwd_ms": ms, "load": 1.0}]
    fp8_step.write_report(tmp_path / "r.md", a, rows)
    text = (tmp_path / "r.md").read_text()
    assert "| 100 Mbit/s | 100 | 101 | 102 | 103 | 104 | 105 | 106 | 1.01 |" in text
    assert "layer fp8 dispatch" in text


def _m6_results():
    def summary(final, acc, settings):
        return {"final_loss": final, "losses": [2.0] * 30 + [final] * 20,
                "caption_accuracy": acc, "heldout_loss": 0.5, "wall_s": 10.0,
                "settings": settings, "global_batch": 48}  # fmt: skip

    fp8 = "FP8 dispatch e4m3 (1x128 blocks, fp32 scales) + expert GEMMs e4m3 (rowwise, pow2 scales)"
    return {"fp32": summary(0.99, 0.95, "fp32, FP8 off"),
            "bf16": summary(1.0, 0.95, "bf16 autocast (fp32 masters), FP8 off"),
            "FP8 + bf16": summary(1.01, 0.94, f"bf16 autocast (fp32 masters), {fp8}"),
            "FP8 + fp32": summary(1.0, 0.95, f"fp32, {fp8}")}  # fmt: skip


def test_m6_fp8_report_compares_with_bf16():
    """The report's facts come from the runs (issue 49 item 18): each run's settings line, the
    global batch it used, this machine; nothing about them is written in by hand."""
    args = argparse.Namespace(argv=["--steps", "50"], config="m6-tiny", steps=50, seed=0)
    text = m6_fp8.report(_m6_results(), args, "x.png")
    assert "| FP8 + bf16 | 1.0100 | +1.00% | 1.0100 | +1.00% | 94.00 | -1.00 |" in text
    assert "- bf16: bf16 autocast (fp32 masters), FP8 off" in text
    assert "- FP8 + fp32: fp32, FP8 dispatch e4m3 (1x128 blocks, fp32 scales)" in text
    assert "global batch 48" in text and "2-core" not in text
    assert f"{os.cpu_count()} cores" in text


def test_m6_fp8_plot_shows_the_differences_to_bf16(tmp_path, monkeypatch):
    """The four loss curves lie on top of each other: a second panel draws each run's
    (smoothed) loss relative to bf16's, where the differences show."""
    figures = []
    monkeypatch.setattr("matplotlib.pyplot.close", figures.append)
    m6_fp8.plot(_m6_results(), tmp_path / "p.png", "m6-tiny")
    top, diff = figures[0].axes
    assert len(top.lines) == 4
    labels = [line.get_label() for line in diff.lines]
    assert labels[:3] == ["fp32 vs bf16", "FP8 + bf16 vs bf16", "FP8 + fp32 vs bf16"]
    assert diff.lines[1].get_ydata()[-1] == pytest.approx(1.0)  # +1% at the end
    assert "FP8 runs: bf16 autocast" in figures[0]._suptitle.get_text()
    assert m6_fp8.smoothed([1.0, 3.0, 5.0], window=2) == [1.0, 2.0, 4.0]


def test_m6_fp8_prints_each_runs_settings_and_accuracy_in_percent(monkeypatch, capsys, tmp_path):
    from examples.m6 import train

    fake = dict(_m6_results()["bf16"], caption_correct=341, caption_total=359)
    monkeypatch.setattr(train, "run", lambda argv: dict(fake))
    args = argparse.Namespace(config="m6-tiny", steps=5, seed=0)
    m6_fp8.train_all(args, tmp_path)
    out = capsys.readouterr().out
    assert "bf16: settings: bf16 autocast (fp32 masters), FP8 off" in out
    assert "held-out accuracy 95.0% (341/359)" in out and "0.9500" not in out
