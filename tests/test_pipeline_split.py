"""The pipeline's even split by parameter count (moe.pipeline.plan_stages(by="params"),
PipelineConfig.split): hand-computed plans, the least largest stage against every split,
and the setting's checks."""

import itertools

import pytest
import torch
from torch import nn

from moe.pipeline import PipelineConfig, plan_stages
from moe.pipeline.split import balance


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
