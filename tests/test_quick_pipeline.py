"""The quick tier's pipeline step (`bash .ci/run --quick`): two stages on two gloo ranks, 1F1B,
equal to one process in float64 (tests/test_pipeline.py runs every schedule and layout)."""

from tests.distributed import run_ranks
from tests.test_pipeline import Case, _check_case, _run_case


def _two_stages(rank, world):
    return _run_case(rank, Case(2, 1, 1, "ddp", "1F1B"))


def test_a_two_stage_pipeline_step_equals_one_process():
    results = run_ranks(_two_stages, 2, timeout=120)
    for rank in range(2):
        _check_case(results[rank], 1, rank)
    assert [results[rank]["first"][0] is None for rank in range(2)] == [True, False]
