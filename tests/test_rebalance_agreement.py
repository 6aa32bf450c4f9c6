"""rebalance_experts refuses, on every rank at once and before anything moves: an optimizer
without the expert parameters, a call between forward and backward, an invalid or per-rank
different min_gain (issue 32, items 4 and 5)."""

import re

import pytest
import torch

import moe
from moe.parallel import init_mesh, parallelize
from moe.parallel.rebalance import rebalance_experts
from tests.distributed import run_ranks

D, F, E = 8, 12, 4


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(moe.MoELayer(D, F, E, top_k=2, aux_loss_coef=0.0))
    with torch.no_grad():
        model[0].router.weight[:2] *= 4.0  # experts 0 and 1 hot, both on rank 0
    return model


def test_backward_pending_follows_the_graph():
    layer = _model()[0]
    x = torch.randn(5, D)
    y = layer(x)
    assert layer.backward_pending()
    y.sum().backward()
    assert not layer.backward_pending()
    y = layer(x)  # dropped without backward: nothing waits
    del y
    assert not layer.backward_pending()
    with torch.no_grad():
        layer(x)
    assert not layer.backward_pending()
    y1, y2 = layer(x), layer(x)  # two micro-batches: pending until both backward
    y2.sum().backward()
    assert layer.backward_pending()
    y1.sum().backward()
    assert not layer.backward_pending()


def test_single_process_refuses_a_pending_backward():
    model = _model()
    y = model(torch.randn(5, D))
    with pytest.raises(ValueError, match="waiting for its backward"):
        rebalance_experts(model, torch.optim.SGD(model.parameters(), lr=0.1))
    y.sum().backward()
    with pytest.raises(ValueError, match="does not hold expert parameter w1"):
        rebalance_experts(model, torch.optim.SGD(model[0].router.parameters(), lr=0.1))
    rebalance_experts(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _case_body(rank, world, case):
    model = parallelize(_model(), init_mesh(dp=1, ep=world), "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    opt.step()
    before = [p.detach().to_local().clone() for p in model[0].experts.parameters()]
    kwargs = {"min_gain": 0.0}
    pending = None
    if case == "router-only optimizer" or case == "router-only optimizer on rank 1" and rank == 1:
        opt = torch.optim.AdamW(model[0].router.parameters(), lr=1e-2)
    elif case == "between forward and backward":
        pending = model(x)
    elif case == "min_gain per rank":
        kwargs["min_gain"] = 0.0 if rank == 0 else 0.1
    elif case == "invalid min_gain on rank 1" and rank == 1:
        kwargs["min_gain"] = 1.5
    with pytest.raises(ValueError) as info:
        rebalance_experts(model, opt, **kwargs)
    after = [p.detach().to_local() for p in model[0].experts.parameters()]
    unchanged = all(torch.equal(a, b) for a, b in zip(after, before))
    slots = model[0].slot_of_expert_E.tolist()
    if pending is not None:  # the forward's backward still works, then the rebalance does
        pending.square().sum().backward()
        opt.step()
        report = rebalance_experts(model, opt, min_gain=0.0)
        assert report.moved_experts > 0
    return str(info.value), unchanged, slots


CASES = {
    "router-only optimizer": "rank 0: 0: the optimizer does not hold expert parameter w1",
    "router-only optimizer on rank 1": "rank 1: 0: the optimizer does not hold",
    "between forward and backward": "rank 0: 0: a training forward is waiting",
    "min_gain per rank": "min_gain differs across ranks: rank 0 has 0.0, rank 1 has 0.1",
    "invalid min_gain on rank 1": r"rank 1: min_gain must be in \[0, 1\), got 1.5",
}


def _cases_body(rank, world):
    return {case: _case_body(rank, world, case) for case in CASES}


def test_every_rank_raises_the_same_error_at_once():
    """2 gloo ranks, each case in turn; a 20 s collective timeout would fail the 5 s check."""
    results = run_ranks(_cases_body, 2, timeout=20, deadline=120)
    for case, message in CASES.items():
        texts = {r[case][0] for r in results}
        assert len(texts) == 1, (case, texts)  # the same error on every rank
        assert re.search(message, texts.pop()), case
        for _, unchanged, slots in (r[case] for r in results):
            assert unchanged and slots == list(range(E)), case  # nothing moved
