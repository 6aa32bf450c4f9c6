"""bench/budget_passes.py: every launch of the bf16 Triton and CUTLASS layers around the GEMMs is
named as a pass (a new pass shows up here, unnamed), and the passes issue 61 item 4 removed stay
removed: the activation recompute for dW2, the inverse map of the sum into tokens rebuilt by sort
+ searchsorted, the zero fill of the row-weight partials, the router's 4 MiB chunks."""

import pytest

from bench import budget, budget_passes
from moe.gating.base import ROUTER_DEVICE_CHUNKS


@pytest.fixture(scope="module")
def tiny():
    return {v: budget_passes.measure(v, budget.TINY) for v in budget_passes.VARIANTS}


@pytest.mark.parametrize("variant", budget_passes.VARIANTS)
def test_every_launch_is_a_named_pass(tiny, variant):
    unnamed = [k for k in tiny[variant] if k not in budget_passes.PASSES]
    assert not unnamed, f"{variant}: launches no pass names ({unnamed}); add a rule to RULES"


def test_the_totals_are_the_budget_counts(tiny):
    """The passes add up to bench.budget's micro-batch-1 launches and bytes."""
    b = budget.measure("bf16 triton", budget.TINY, 1).first
    passes = tiny["bf16 triton"].values()
    assert sum(p.launches for p in passes) == b.launches
    assert sum(p.bytes for p in passes) == b.bytes_outside


def test_removed_passes_stay_removed(tiny):
    for variant, passes in tiny.items():
        assert "act recompute" not in passes, variant  # s * act(pre) from the act backward
        assert passes["combine map"].launches <= 2, variant  # one sort of [T, k] (+ its copy)
        assert passes["router upcast"].launches <= 3 * ROUTER_DEVICE_CHUNKS, variant
    assert tiny["bf16 triton"]["row weight grad"].launches == 1  # the partials' sum, no zeros
    assert tiny["bf16 triton"]["wgrad order"].launches <= 5  # one expert order, both GEMMs
    assert "act" not in tiny["bf16 triton"] and "act bwd" not in tiny["bf16 triton"]


def test_classify_rules():
    c = budget_passes.classify
    assert (
        c(("kernels/triton/activations.py", "act_rows"), "triton _act_rows_kernel", False) == "act"
    )
    assert (
        c(("kernels/triton/activations.py", "act_rows"), "triton _act_rows_kernel", True)
        == "act recompute"
    )
    assert c(("kernels/triton/gather_sum.py", "rows_to_tokens"), "sort", True) == "combine map"
    assert c(None, "mul", False) == "harness" and c(None, "add", True) == "x grad sum"
    assert (
        c(("kernels/new_thing.py", "f"), "abs", False) == "unnamed: abs at kernels/new_thing.py:f"
    )
