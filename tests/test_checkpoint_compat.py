"""Checkpoints written by an older release still load: tests/data/ckpt-0afafd8 and
tests/data/ckpt-7b9a55a were saved by main at those commits (tools/compat_checkpoint.py: 2 ranks,
ep 2, a rebalanced placement and a rebalanced replica layout, AdamW state; from 7b9a55a also a
layer with FP8 dispatch and FP8 experts, `--fp8`), each with the canonical state that release
read back from it. Every later release must read exactly that."""

import pathlib

import pytest
import torch
from safetensors.torch import load_file

from moe.checkpoint import load_checkpoint
from tools.compat_checkpoint import build, canonical_state

DATA = pathlib.Path(__file__).parent / "data"
FIXTURES = {"0afafd8": {}, "7b9a55a": {"fp8": True}}  # commit -> build() options it saved


@pytest.mark.parametrize("commit", sorted(FIXTURES))
def test_checkpoint_of_an_older_release_loads_exactly(commit):
    model = build(**FIXTURES[commit])
    data = DATA / f"ckpt-{commit}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in canonical_state(model, opt).items() if "/param" in k}
    assert load_checkpoint(str(data / "ckpt"), model, opt) == {"step": 3}
    got, expected = canonical_state(model, opt), load_file(data / "expected.safetensors")
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert any(not torch.equal(before[k], got[k]) for k in before)  # the load changed weights
