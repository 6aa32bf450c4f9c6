"""Every transformers family on the experts contract (@use_experts_implementation), tiny and
random, each built once and checked two ways (tests/hf_matrix.py): experts_implementation="moe"
(moe.interop.hf_experts) and the generic conversion (moe.from_hf, moe.interop.hf_contract).
Logits, loss and every gradient equal transformers' eager run (float64, 1e-10 relative, where
transformers runs in float64), or from_hf refuses with one error: a silent mismatch fails.
Each figure agrees with the support table's (tests/data/hf_support.json, tools/hf_support.py),
and the docs table is that JSON's rendering."""

import json

import pytest

pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

import torch  # noqa: E402

import moe  # noqa: E402
from tests.hf_matrix import SUPPORT, TABLE_TOL, agrees, check_family, support  # noqa: E402
from tests.hf_tiny import NOT_BUILT, contract_families, tiny_model  # noqa: E402

FAMILIES = [f for f in contract_families() if f not in NOT_BUILT]
# Refused by from_hf (each with one error naming what): Ergo's experts wrap the contract's
# forward in their own, with a per-expert norm no flag declares. Every other family converts.
REFUSED = {"ergo": "post_expert_norm"}


def test_matrix_covers_the_contract():
    """The walk covers every family on the contract but the listed ones, and enough of them."""
    assert set(contract_families()) >= set(NOT_BUILT)
    assert len(FAMILIES) >= 24


@pytest.mark.parametrize("family", FAMILIES)
def test_family_on_moe(family):
    r = check_family(family)
    assert r.ran_eager and r.ran_moe == r.ran_eager, family  # the same experts calls...
    assert r.moe_ran_all, family  # ...each on moe's forward
    worst = max(r.impl_errors, key=r.impl_errors.get)
    assert r.impl_errors[worst] <= r.tol, (family, worst, r.impl_errors[worst])
    row = support()[family]  # the support table's figures: what this test measured
    assert agrees(r.impl_errors[worst], row["moe"]), (family, r.impl_errors[worst], row["moe"])
    assert (r.converted is None) == (family in REFUSED), (family, r.refusal)
    if r.converted is None:  # refused: one error naming the experts class and the flag
        assert "cannot be converted" in r.refusal and "Experts" in r.refusal, r.refusal
        assert REFUSED[family] in r.refusal, r.refusal
        assert isinstance(row["convert"], str) and row["convert"].startswith("refused"), family
        return
    assert r.state_dict_exact, family  # to_hf gives back the same state dict, bit for bit
    tol = max(r.tol, TABLE_TOL) if r.converted == "table" else r.tol
    worst = max(r.conversion_errors, key=r.conversion_errors.get)
    assert r.conversion_errors[worst] <= tol, (family, worst, r.conversion_errors[worst])
    assert agrees(r.conversion_errors[worst], row["convert"]), (family, row["convert"])


def test_docs_table_is_the_measured_one():
    """docs/hf-contract.md's support table renders tests/data/hf_support.json (the figures the
    tests above compare with theirs); the JSON covers every family on the contract."""
    from tools.hf_support import doc_table, render

    data = json.loads(SUPPORT.read_text())
    assert list(data["families"]) == contract_families()
    assert doc_table() == render(data)


def test_experts_per_token_unnamed_is_refused():
    """A config naming its experts per token under no known name is refused at conversion,
    before any change (Gemma 4's `top_k_experts` was read as 1: the first forward failed)."""
    model = tiny_model("gemma4", torch.float64)
    config = model.config.get_text_config()
    top_k = config.top_k_experts
    del config.top_k_experts
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="experts per token under none of"):
        moe.from_hf(model)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert not moe.moe_layers(model)
    config.top_k_experts = top_k
    assert moe.moe_layers(moe.from_hf(model))
