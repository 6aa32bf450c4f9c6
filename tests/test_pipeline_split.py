"""The pipeline's even split by parameter count (moe.pipeline.plan_stages(by="params"),
PipelineConfig.split): hand-computed plans, the least largest stage against every split,
and the setting's checks."""

import itertools
from collections import OrderedDict

import pytest
import torch
from torch import nn

from moe.pipeline import PipelineConfig, plan_stages
from moe.pipeline.split import balance, build_stage


def _linear_stack(widths):
    """nn.Linear(w, 1, bias=False) children: child i holds widths[i] parameters."""
    return nn.Sequential(*[nn.Linear(w, 1, bias=False) for w in widths])


def test_split_by_params_hand_computed():
    # 10 | 1 1 1 1 | 10: the largest stage at 3 stages is 10, earlier stages as full as allowed
    stack = _linear_stack([10, 1, 1, 1, 1, 10])
    assert plan_stages(stack, 3, by="params") == [["0"], ["1", "2", "3", "4"], ["5"]]
    assert plan_stages(stack, 3) == [["0", "1"], ["2", "3"], ["4", "5"]]  # by child count
    # 4 4 4 4 8 in 2: 12 | 12 (child count would give 4 4 4 | 4 8 = 12 | 12 too)
    assert balance([4, 4, 4, 4, 8], 2) == [3, 2]
    # 8 1 1 1 1 1 1 in 2: 8 | 6 (child count: 8 1 1 1 | 1 1 1 = 11 | 3)
    assert balance([8, 1, 1, 1, 1, 1, 1], 2) == [1, 6]
    # ties: 2 2 2 2 in 3 -> largest 4; earlier stages take two: 4 | 2 | 2
    assert balance([2, 2, 2, 2], 3) == [2, 1, 1]
    assert balance([5, 5, 5], 3) == [1, 1, 1]
    assert balance([3, 1, 1, 1, 1, 1, 3], 1) == [7]
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        balance([1, 1], 3)


def _largest(w, sizes):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return max(sum(w[a : a + s]) for a, s in zip(starts, sizes))


def test_split_by_params_is_least_largest_stage():
    """Every split of random weights: balance's largest stage is the least (exhaustive)."""

    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        n = int(torch.randint(2, 8, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        w = torch.randint(1, 50, (n,), generator=g).tolist()
        sizes = balance(w, k)
        assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1

        best = min(
            _largest(w, [b - a for a, b in zip((0, *cut), (*cut, n))])
            for cut in itertools.combinations(range(1, n), k - 1)
        )
        assert _largest(w, sizes) == best, (w, k, sizes)


def test_split_setting_is_checked_and_recorded():
    with pytest.raises(ValueError, match="PipelineConfig.split must be one of"):
        PipelineConfig(split="layers")
    assert PipelineConfig(split="params").record()["pipeline.split"] == "params"
    with pytest.raises(ValueError, match="split must be one of"):
        plan_stages(_linear_stack([1, 2]), 2, by="flops")


# -- one parameter at two positions (issue 62 items 1, 2) ------------------------------------
def _tied():
    embed, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = embed.weight  # tied input / output embedding
    return nn.Sequential(OrderedDict(embed=embed, mid=nn.Linear(4, 4), head=head))


def test_tied_weights_are_refused_naming_both_places():
    shared = r"embed.weight \(child 'embed'\) and head.weight \(child 'head'\) are one parameter"
    for stages in (2, 3):
        with pytest.raises(ValueError, match=shared):
            plan_stages(_tied(), stages)
    with pytest.raises(ValueError, match=shared):  # even a given plan
        plan_stages(_tied(), 2, [["embed", "mid"], ["head"]])


def test_a_block_used_twice_is_refused_naming_both_positions():
    block = nn.Linear(3, 3)
    stack = nn.Sequential(block, nn.Linear(3, 3), block)
    with pytest.raises(ValueError, match=r"0.weight \(child '0'\) and 2.weight \(child '2'\)"):
        plan_stages(stack, 2)
    inner = nn.Linear(3, 3)  # shared deeper down: two children holding one module
    stack = nn.Sequential(nn.Sequential(inner, nn.ReLU()), nn.Sequential(nn.Tanh(), inner))
    with pytest.raises(ValueError, match=r"0.0.weight \(child '0'\) and 1.1.weight \(child '1'\)"):
        plan_stages(stack, 2)


def test_a_parameterless_module_used_twice_keeps_every_position():
    """nn.Sequential runs every position; the split keeps each (named_children() skips a
    repeated module, which dropped the second run of it)."""
    torch.manual_seed(0)
    act = nn.Tanh()
    stack = nn.Sequential(nn.Linear(3, 3), act, nn.Linear(3, 3), act).double()
    plan = plan_stages(stack, 2)
    assert plan == [["0", "1"], ["2", "3"]]
    assert plan_stages(stack, 2, by="params") == [["0", "1"], ["2", "3"]]
    x = torch.randn(5, 3, dtype=torch.float64)
    y = x
    for names in plan:
        y = build_stage(stack, names, aux_scale=1.0)(y)
    torch.testing.assert_close(y, stack(x), rtol=0, atol=0)


def _repeated_act():
    torch.manual_seed(0)
    act = nn.Tanh()  # one module at positions 1 and 3, on both stages
    return nn.Sequential(nn.Linear(3, 3), act, nn.Linear(3, 3), act).double()


def _shared_body(rank, world):
    from moe.pipeline import Pipeline, init_pipeline_mesh

    mesh = init_pipeline_mesh(2, 1, 1)
    loss = lambda y, t: (y - t).square().sum()  # noqa: E731
    try:
        Pipeline(_tied().double(), mesh, PipelineConfig(microbatches=2), loss)
        message = "no error"
    except ValueError as e:
        message = str(e)
    pipe = Pipeline(_repeated_act(), mesh, PipelineConfig(microbatches=2), loss)
    x, t = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    out, _ = pipe.step(x, t)
    grads = {n: p.grad.full_tensor() for n, p in pipe.named_parameters()}
    return message, x, t, out, grads


def test_pipeline_refuses_tied_weights_and_runs_a_repeated_module_at_each_position():
    from tests.distributed import run_ranks

    results = run_ranks(_shared_body, 2, timeout=120)
    for message, *_ in results:
        assert "embed.weight (child 'embed') and head.weight (child 'head')" in message, message
    _, x, t, out, _ = results[1]  # the last stage's output: the whole stack's, Tanh twice
    model = _repeated_act()
    y = model(x)
    torch.testing.assert_close(out, y.detach(), rtol=1e-12, atol=1e-12)
    (y - t).square().sum().backward()
    for rank, names in ((0, {"0.weight", "0.bias"}), (1, {"2.weight", "2.bias"})):
        grads = results[rank][4]
        assert set(grads) == names
        for n, g in grads.items():
            torch.testing.assert_close(g, model.get_parameter(n).grad, rtol=1e-12, atol=1e-12)
