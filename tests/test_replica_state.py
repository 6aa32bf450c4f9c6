"""The replica gradient state machine (moe.slots.guard, issue 41 items 1, 2, 3, 8): every
entry point (sum, step, clip, rebalance, compile) consults one state per layer. Each odd call
is either exact (float64, against the same model without spare slots) or one clear error
before anything changes."""

import pytest
import torch

import moe
from moe.parallel.rebalance import rebalance_experts
from moe.parallel.replicas import sum_replica_grads
from moe.slots.guard import ReplicaGradsNotSummed
from tests.test_replicas import TOL64, D, _canonical, _pair


def _backward(model, x):
    (model(x).square().sum() + moe.aux_loss(model)).backward()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sum_twice_is_one_sum_and_a_sum_per_micro_batch_is_refused():
    ref, rep = _pair(3)
    x = torch.randn(29, D, dtype=torch.float64)
    first, second = x.tensor_split(2)
    _backward(rep, first)
    sum_replica_grads(rep)
    _backward(rep, second)  # accumulates on top of the summed gradients
    before = _grads(rep)
    with pytest.raises(ReplicaGradsNotSummed, match="accumulated on top of summed ones"):
        sum_replica_grads(rep)
    for name, g in _grads(rep).items():  # nothing changed
        assert torch.equal(g, before[name]), name
    opt = torch.optim.SGD(rep.parameters(), lr=0.1)
    with pytest.raises(ReplicaGradsNotSummed, match="SGD.step"):
        opt.step()
    rep.zero_grad()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for model in (ref, rep):  # the same step done right: two micro-batches, then two sums
        _backward(model, first)
        _backward(model, second)
    assert sum_replica_grads(rep) > 0
    assert sum_replica_grads(rep) == 0  # nothing arrived since: a no-op
    ga, gb = _canonical(ref, grads=True), _canonical(rep, grads=True)
    for name, g in ga.items():
        torch.testing.assert_close(gb[name], g, **TOL64, msg=name)
    ref_opt.step()
    opt.step()
    assert sum_replica_grads(rep) == 0  # after the step, before a backward: still nothing
    pa, pb = _canonical(ref), _canonical(rep)
    for name, p in pa.items():
        torch.testing.assert_close(pb[name], p, **TOL64, msg=name)


def test_rebalance_with_unsummed_copies_is_refused_and_without_copies_runs():
    ref, rep = _pair(3)
    x = torch.randn(16, D, dtype=torch.float64)
    for model in (ref, rep):
        _backward(model, x)  # a micro-batch done, the next to come
    rebalance_experts(ref)  # no copies: weights and gradients move exactly (here: a no-op)
    before = _grads(rep)
    with pytest.raises(ValueError, match="rebalance_experts: .*unsummed gradients"):
        rebalance_experts(rep)
    for name, g in _grads(rep).items():
        assert torch.equal(g, before[name]), name
    sum_replica_grads(rep)
    rebalance_experts(rep)  # summed: every copy holds the whole gradient, it may move
    opt = torch.optim.SGD(rep.parameters(), lr=0.1)
    moe.parallel.clip_grad_norm_(rep, 0.01)  # rewrites summed gradients: still summed
    opt.step()


def test_frozen_experts_with_spare_slots_step_like_without_copies():
    ref, rep = _pair(3)
    x = torch.randn(29, D, dtype=torch.float64)
    opts = []
    for model in (ref, rep):
        for layer in (model[1], model[3]):
            layer.experts.requires_grad_(False)
        opts.append(torch.optim.AdamW(model.parameters(), lr=0.01))  # over every parameter
    for _ in range(2):
        for model, opt in zip((ref, rep), opts):
            _backward(model, x)
            assert sum_replica_grads(model) == 0
            opt.step()
            opt.zero_grad()
    pa, pb = _canonical(ref), _canonical(rep)
    for name, p in pa.items():
        torch.testing.assert_close(pb[name], p, **TOL64, msg=name)


def test_compiled_model_step_without_sum_is_refused_and_with_sum_exact():
    ref, rep = (torch.nn.Sequential(model[1]) for model in _pair(3))  # one layer: a quick trace
    compiled = torch.compile(rep, backend="eager")
    x = torch.randn(29, D, dtype=torch.float64)
    opt = torch.optim.SGD(rep.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        _backward(ref, x)
        _backward(compiled, x)
        if step == 0:
            assert rep[0].ran_compiled  # traced: no eager backward mark, the gradients watched
            with pytest.raises(ReplicaGradsNotSummed, match="SGD.step"):
                opt.step()
            with pytest.raises(ReplicaGradsNotSummed, match="clip_grad_norm_"):
                moe.parallel.clip_grad_norm_(rep, 1.0)
        sum_replica_grads(rep)
        moe.parallel.clip_grad_norm_(rep, 1.0)
        moe.parallel.clip_grad_norm_(ref, 1.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step == 0)  # both ways of zeroing
        ref_opt.zero_grad()
    pa, pb = _canonical(ref), _canonical(rep)
    for name, p in pa.items():
        torch.testing.assert_close(pb[name], p, **TOL64, msg=name)
