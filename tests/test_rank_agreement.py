"""A failure or a differing value on one rank becomes the same named error on every rank, at
once (issue 32 item 5): the agreement helper itself, load_checkpoint's check_extra callback,
and the low-level all_to_all_splits with per-rank cost models. Real gloo ranks whose collective
timeout (20 s) is far longer than the time each error may take: the old code waited it out."""

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe.checkpoint import load_checkpoint, save_checkpoint
from moe.comm import (
    NVLINK_IB,
    CrossRankError,
    ExchangeConfig,
    all_to_all_splits,
    raise_if_any_rank_failed,
    same_error_on_every_rank,
)
from tests.distributed import run_ranks

TIMEOUT = 20.0  # the process group's collective timeout
SLOW_NETWORK = replace(NVLINK_IB, a_inter=1e-3)  # 2D wins below ~0.5 GB at 2 nodes x 2 ranks


def _outcome(fn) -> tuple[str, str]:
    """(error class name, message) of fn(), ("", "") if it returned. An agreed error is the
    same on every rank; a rank left waiting in a collective would raise the process group's
    timeout instead (another class and text), and a hang is bounded by run_ranks' deadline."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return type(e).__name__, str(e)
    return "", ""


def _failing_on(rank: int, failing: int, exc: Exception):
    def block():
        with same_error_on_every_rank(what="step"):
            if rank == failing:
                raise exc

    return block


def _helper_body(rank, world, path):
    out = {
        "runtime on rank 1": _outcome(_failing_on(rank, 1, RuntimeError("boom"))),
        "nobody": _outcome(_failing_on(rank, 5, RuntimeError("never"))),
        "same on both": _outcome(
            lambda: raise_if_any_rank_failed(ValueError("bad size"), what="x")
        ),
        "values differ": _outcome(
            lambda: raise_if_any_rank_failed(None, what="z", values={"k": 2, "min_gain": rank})
        ),
        "values agree": _outcome(lambda: raise_if_any_rank_failed(None, values={"k": 2})),
        "lists": _outcome(
            lambda: raise_if_any_rank_failed([f"a{rank}", "b"], error=KeyError, what="y")
        ),
    }
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(path, model, opt, extra={"step": 4})

    def check(extra):
        if rank == 1:
            raise RuntimeError(f"the callback broke on step {extra['step']}")

    before = [p.detach().clone() for p in model.parameters()]
    out["check_extra"] = _outcome(lambda: load_checkpoint(path, model, opt, check_extra=check))
    out["unchanged"] = all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    dist.barrier()  # the group still works after every agreed error
    return out


def test_a_failure_on_one_rank_is_the_same_error_on_every_rank_at_once(tmp_path):
    r0, r1 = run_ranks(_helper_body, 2, str(tmp_path), timeout=TIMEOUT, deadline=120)
    for case in ("runtime on rank 1", "same on both", "values differ", "lists", "check_extra"):
        assert r0[case] == r1[case], case  # same class, same text
    assert r0["runtime on rank 1"] == ("CrossRankError", "step: rank 1: RuntimeError: boom")
    assert r0["nobody"] == ("", "")
    assert r0["same on both"] == ("CrossRankError", "x: ranks 0-1: bad size")
    assert r0["values differ"] == (
        "CrossRankError",
        "z: min_gain differs across ranks: rank 0 has 0, rank 1 has 1",
    )
    assert r0["values agree"] == ("", "")
    assert r0["lists"][0] == "KeyError"
    for line in ("rank 0: a0", "rank 1: a1", "ranks 0-1: b"):
        assert line in r0["lists"][1]
    kind, message = r0["check_extra"]
    assert kind == "CheckpointError"
    assert "rank 1: extra: RuntimeError: the callback broke on step 4" in message
    assert r0["unchanged"] and r1["unchanged"]


def test_single_process_keeps_the_text_and_the_cause():
    with (
        pytest.raises(CrossRankError, match=r"^what: RuntimeError: boom$") as info,
        same_error_on_every_rank(what="what"),
    ):
        raise RuntimeError("boom")
    assert isinstance(info.value.__cause__, RuntimeError)
    with same_error_on_every_rank():
        pass
    raise_if_any_rank_failed(None)
    raise_if_any_rank_failed([])


def _plan_body(rank, world, bad_profile):
    x_ND = torch.randn(world + rank, 4)
    counts = [1] * (world - 1) + [1 + rank]

    def plan(exchange=None):
        return all_to_all_splits(
            x_ND, counts, algorithm="auto", ranks_per_node=2, exchange_config=exchange
        )

    out = {}
    # node 0 has a cost model, node 1 none
    mixed = ExchangeConfig(cost_model=SLOW_NETWORK if rank < 2 else None)
    out["models differ"] = _outcome(lambda: plan(mixed))
    if rank == 3:
        os.environ["MOE_A2A_COST_PROFILE"] = bad_profile
    out["unreadable on rank 3"] = _outcome(plan)
    os.environ["MOE_A2A_COST_PROFILE"] = bad_profile
    out["unreadable everywhere"] = _outcome(plan)
    os.environ.pop("MOE_A2A_COST_PROFILE", None)
    out["same"] = plan(ExchangeConfig(cost_model=SLOW_NETWORK)).algorithm  # the same: plans
    return out


def test_plan_all_to_all_with_per_rank_cost_models_is_one_error_on_every_rank(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text('{"version": 1, "model": {"a_coll": 1e400}}')
    results = run_ranks(_plan_body, 4, str(bad), timeout=TIMEOUT, deadline=150)
    for case in ("models differ", "unreadable on rank 3", "unreadable everywhere"):
        assert len({r[case] for r in results}) == 1, [r[case] for r in results]
        assert results[0][case][0] == "CrossRankError"
    message = results[0]["models differ"][1]
    assert "the hierarchical threshold differs across ranks: ranks 0-1 have" in message
    assert "ranks 2-3 have 0 bytes" in message
    assert "rank 3 has unreadable" in results[0]["unreadable on rank 3"][1]
    everywhere = results[0]["unreadable everywhere"][1]
    assert "unreadable on every rank" in everywhere and str(bad) in everywhere, everywhere
    assert {r["same"] for r in results} == {"hierarchical"}
