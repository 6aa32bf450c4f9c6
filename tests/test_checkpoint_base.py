"""An adapters-only checkpoint (save_checkpoint(trainable_only=True)) records the frozen base it
was trained on (moe.checkpoint.base) and refuses another base with one clear error, the model
unchanged (issue 62 item 7: it loaded onto another base without a word, logits 0.50 off)."""

import pytest
import torch

import moe
from moe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moe.checkpoint.base import fingerprint
from moe.lora import LoRAConfig, adapter_parameters, add_lora

D, F, E = 8, 12, 4


def _model(base_seed, adapter_seed=0, spare_slots=0):
    torch.manual_seed(base_seed)
    model = torch.nn.Sequential(
        *[
            moe.MoELayer(D, F, E, top_k=2, activation="swiglu", spare_slots=spare_slots)
            for _ in range(2)
        ]
    ).double()
    add_lora(model, LoRAConfig(rank=2, alpha=4.0))
    g = torch.Generator().manual_seed(100 + adapter_seed)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def test_adapters_load_onto_their_base_and_another_base_is_refused(tmp_path):
    x = torch.randn(7, D, dtype=torch.float64)
    src = _model(base_seed=0)
    save_checkpoint(str(tmp_path), src, trainable_only=True)
    same = _model(base_seed=0, adapter_seed=1)  # the base, other adapters
    load_checkpoint(str(tmp_path), same)
    torch.testing.assert_close(same(x), src(x), rtol=0, atol=0)
    other = _model(base_seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="trained on another base model: 8 frozen param"):
        load_checkpoint(str(tmp_path), other)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    nudged = _model(base_seed=0)  # one weight of the base moved by 1e-6: another base
    with torch.no_grad():
        nudged[1].experts.w2[2, 3, 1] += 1e-6
    with pytest.raises(CheckpointError, match=r"\(1.experts.w2\)"):
        load_checkpoint(str(tmp_path), nudged)
    load_checkpoint(str(tmp_path), other, allow_config_change=True)  # said so: loaded
    for n, p in adapter_parameters(other):
        assert torch.equal(p, dict(src.named_parameters())[n])


def test_fingerprint_reads_experts_in_canonical_order():
    """Spare slots hold copies of experts: the fingerprint is the canonical experts' one."""
    plain, spare = _model(0), _model(0, spare_slots=2)
    with torch.no_grad():
        for layer_p, layer_s in zip(plain, spare):
            slot_E = layer_s.slot_of_expert_E
            for n in ("w1", "w2", "w3"):
                w = getattr(layer_s.experts, n)
                w.copy_(getattr(layer_p.experts, n)[layer_s.expert_of_slot()])
            layer_s.router.weight.copy_(layer_p.router.weight)
            assert slot_E.numel() == E
    got, want = fingerprint(spare), fingerprint(plain)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name][0] == want[name][0], name
        for a, b in zip(got[name][1:], want[name][1:]):
            assert abs(a - b) <= 1e-12 * (abs(b) + 1), name
