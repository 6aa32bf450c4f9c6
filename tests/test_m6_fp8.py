"""The M6 example's --fp8 (issue 40): the flag reaches every MoE layer, bad values and a dense
model are one `error:` line, --resume refuses a changed --fp8 naming it, and with --ep 2 on gloo
ranks (ddp and fsdp) the FP8 run equals the single process on the same global batch."""

import contextlib
import io
import math

import pytest

import moe
from examples.m6 import train
from examples.m6.config import get_config
from tests.distributed import run_ranks

FAST = ["--quiet", "--no-plots", "--eval-every", "1000", "--global-batch", "32"]


def test_fp8_reaches_every_moe_layer():
    for mode, dispatch, experts in (("dispatch", True, False), ("experts", False, True),
                                    ("all", True, True)):  # fmt: skip
        model = get_config("m6-tiny").replace(fp8=mode).build()
        layers = moe.moe_layers(model)
        assert layers and all(
            (layer.config.fp8.dispatch, layer.config.fp8.experts) == (dispatch, experts)
            for _, layer in layers
        )
    off = moe.moe_layers(get_config("m6-tiny").build())
    assert all(layer.config.fp8 is None for _, layer in off)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fp8", "fp4"], "--fp8 must be one of off, dispatch, experts, all, got 'fp4'"),
        (["--fp8", "all", "--dense"], "--fp8 all needs an MoE model; m6-tiny-dense is dense"),
    ],
)
def test_bad_fp8_is_one_error_line(tmp_path, capsys, argv, message):
    assert train.main([*argv, "--run-dir", str(tmp_path), *FAST]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"


def test_fp8_trains_and_resume_refuses_a_changed_fp8(tmp_path, capsys):
    argv = ["--steps", "4", "--run-dir", str(tmp_path), *FAST]
    half = train.run([*argv, "--fp8", "all", "--stop-after", "2"])
    plain = train.run([*argv, "--stop-after", "2", "--run-dir", str(tmp_path / "plain")])
    assert len(half["losses"]) == 2 and all(math.isfinite(v) for v in half["losses"])
    for fp8, exact in zip(half["losses"], plain["losses"]):  # the same batches and weights:
        assert fp8 != exact and abs(fp8 - exact) <= 1e-2 * exact  # quantized (measured 1e-4)
    assert train.main([*argv, "--resume"]) == 2  # the checkpoint was trained with --fp8 all
    err = capsys.readouterr().err
    assert err.startswith("error: --resume: ") and "fp8: checkpoint 'all', now 'off'" in err
    rest = train.run([*argv, "--fp8", "all", "--resume"])
    assert rest["steps_this_run"] == 2 and len(rest["losses"]) == 4


def _two_ranks(rank, world_size, run_dir):
    argv = ["--steps", "3", "--run-dir", run_dir, "--dp", "1", "--ep", "2", "--fp8", "all", *FAST]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        status = train.main([*argv, "--fp8", "fp4"])
    assert status == 2 and err.getvalue().startswith("error: --fp8 must be one of")
    return [train.run([*argv, "--data-parallel", dp])["losses"] for dp in ("ddp", "fsdp")]


def test_fp8_with_ep_on_two_ranks_equals_one_process(tmp_path):
    single = train.run(["--steps", "3", "--run-dir", str(tmp_path / "one"), "--fp8", "all",
                        "--micro-batch", "16", *FAST])["losses"]  # fmt: skip
    ranks = run_ranks(_two_ranks, 2, str(tmp_path / "ep2"), timeout=120)
    assert ranks[0] == ranks[1]
    for losses in ranks[0]:  # ddp, fsdp
        assert losses == pytest.approx(single, abs=1e-5, rel=1e-5)
