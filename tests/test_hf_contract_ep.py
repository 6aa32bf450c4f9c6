"""Every family moe.from_hf converts (the support table's, tests/data/hf_support.json), under
expert parallelism and in pipeline stages on gloo (tests/hf_matrix_ranks.py), one start of the
ranks for all of them, float64 (float32 and its tolerance where transformers does not run the
family in float64, tests/hf_matrix.SETTINGS):
- EP = 2 (ddp; FSDP2 for four of them) equals one process on the global batch: logits, loss,
  every gradient (a rank's shard against its slice), within 1e-6 relative (the routers compute
  in float32, whose rounding depends on the batch: GLM-4.5's gate gradient 6e-8 between one
  process's sum over 4 sequences and two ranks' sums over 2);
- pp = 2 through moe.pipeline.hf_stack (a multimodal model's text path: text_only=True; tied
  embeddings untied) equals one process on the same micro-batches within 1e-12, or hf_stack
  refuses with one error naming why;
and each figure agrees with the support table's (tests/hf_matrix.agrees)."""

import pytest

pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from tests import hf_matrix_ranks as ranks_  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.hf_matrix import agrees, support  # noqa: E402

FAMILIES = [f for f, row in support().items() if isinstance(row.get("convert"), float)]
EP_CASES = [(f, "ddp") for f in FAMILIES] + [(f, "fsdp") for f in ranks_.FSDP if f in FAMILIES]


@pytest.fixture(scope="module")
def results():
    return run_ranks(ranks_.body, 2, EP_CASES, FAMILIES, timeout=300)


def test_matrix_is_large_enough():
    multimodal = [f for f in FAMILIES if support()[f]["layout"].startswith("multimodal")]
    assert len(FAMILIES) >= 24 and len(multimodal) >= 3, (FAMILIES, multimodal)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_equals_one_process(results, family):
    for data_parallel in ("ddp", "fsdp"):
        if (family, data_parallel) not in EP_CASES:
            continue
        errors = ranks_.ep_errors(family, data_parallel, results)
        assert not isinstance(errors, str), (family, data_parallel, errors)
        worst = max(errors, key=errors.get)
        tol = ranks_.dtype_tol(family, ranks_.EP_TOL)[1]
        assert errors[worst] <= tol, (family, data_parallel, worst, errors[worst])
        column = "ep" if data_parallel == "ddp" else "ep_fsdp"
        assert agrees(errors[worst], support()[family][column]), (family, column)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_equals_one_process(results, family):
    errors = ranks_.pp_errors(family, results)
    if isinstance(errors, str):  # refused: one error naming why (or a sampling router)
        named = errors.startswith("hf_stack: ") and (
            "cannot be split" in errors or "is not a supported causal LM" in errors
        )
        assert named or family in ranks_.SAMPLED, errors
        assert agrees(errors, support()[family]["pipeline"]), family
        return
    worst = max(errors, key=errors.get)
    assert errors[worst] <= ranks_.dtype_tol(family, ranks_.PP_TOL)[1], (family, worst)
    assert agrees(errors[worst], support()[family]["pipeline"]), family
