"""The rule parallelize() relies on for expert gradients, checked on every branch of FSDP2's
gradient division, including the NCCL-only ones (AVG) that gloo tests cannot reach.

parallelize() leaves FSDP2 its default divide factor (the mean over the group it reduces over)
and divides the reduced shard by ep itself. This holds only if FSDP2's default divides by
exactly the data-parallel size in every branch of `_get_gradient_divide_factors` (float32 /
bf16 vs the pre/post-divide "overflow risk" dtypes, forced SUM or not) and on the path that
copies instead of reduce-scattering over one rank. The scaling steps below are those of
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_reduce.
"""

import pytest
import torch
from torch.distributed import ReduceOp
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
GROUPS = [(1, None), (2, None), (4, None), (1, 1), (1, 2), (1, 4), (2, 2)]  # (rs, all-reduce)


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _op_scale(op, size: int) -> float:
    if op == ReduceOp.AVG:
        return 1 / size
    assert op == ReduceOp.SUM, op
    return 1.0


def _total_scale(rs: int, ar: int | None, dtype, force_sum: bool, factor) -> float:
    """What FSDP2's reduction multiplies the sum of the ranks' gradients by."""
    pre, post, rs_op, ar_op = _get_gradient_divide_factors(
        _Group(rs), None if ar is None else _Group(ar), dtype, "cuda", factor, force_sum
    )
    scale = 1.0 / (pre or 1)
    if rs > 1:
        scale *= _op_scale(rs_op, rs)
    elif factor is not None:  # one rank: a copy divided by the custom factor
        scale /= factor
    if ar is not None:
        scale *= _op_scale(ar_op, ar)
    return scale / (post or 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("force_sum", [False, True])
@pytest.mark.parametrize("rs, ar", GROUPS)
def test_default_factor_is_the_mean_over_the_group_in_every_branch(dtype, force_sum, rs, ar):
    dp = rs * (ar or 1)
    assert _total_scale(rs, ar, dtype, force_sum, None) == pytest.approx(1 / dp, rel=1e-12)


def test_a_custom_factor_was_applied_twice_on_one_rank_for_float64():
    """Why parallelize no longer sets one: dp=1 or replicate, float64, world 4: 1/16."""
    assert _total_scale(1, 1, torch.float64, False, 4.0) == pytest.approx(1 / 16)
    assert _total_scale(1, 1, torch.float32, False, 4.0) == pytest.approx(1 / 4)
