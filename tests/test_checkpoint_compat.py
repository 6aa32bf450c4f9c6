"""Checkpoints written by an older release still load: tests/data/ckpt-0afafd8 was saved by
main at 0afafd8 (tools/compat_checkpoint.py: 2 ranks, ep 2, a rebalanced placement and a
rebalanced replica layout, AdamW state), with the canonical state that release read back from
it. Every later release must read exactly that."""

import pathlib

import torch
from safetensors.torch import load_file

from moe.checkpoint import load_checkpoint
from tools.compat_checkpoint import build, canonical_state

DATA = pathlib.Path(__file__).parent / "data" / "ckpt-0afafd8"


def test_checkpoint_of_0afafd8_loads_exactly():
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in canonical_state(model, opt).items() if "/param" in k}
    assert load_checkpoint(str(DATA / "ckpt"), model, opt) == {"step": 3}
    got, expected = canonical_state(model, opt), load_file(DATA / "expected.safetensors")
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert any(not torch.equal(before[k], got[k]) for k in before)  # the load changed weights
