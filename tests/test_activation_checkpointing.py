"""Activation checkpointing: MoELayer(recompute=True) and recompute_blocks give the same
outputs and gradients as the plain model, also for routers that draw random numbers."""

import copy

import pytest
import torch
from torch import nn

import moe
from moe.memory import recompute_blocks
from moe.memory.recompute import find_repeated_blocks
from tests.test_planner import TinyConfig, loss_of, measured_activation_bytes

ROUTERS = [
    ("topk", 2, {}),
    ("gshard", 2, {"capacity_factor": 1.0}),  # random second-expert routing
    ("switch", 1, {"capacity_factor": 1.25, "jitter_eps": 0.1}),  # input jitter
    ("noisy_topk", 2, {}),  # logits noise
]


def grads_of(module: nn.Module, x: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    y = module(x)
    (y.square().mean() + module.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("router,k,options", ROUTERS, ids=[r[0] for r in ROUTERS])
def test_checkpointed_layer_has_identical_gradients(router, k, options):
    torch.manual_seed(0)
    plain = moe.MoELayer(16, 24, num_experts=6, top_k=k, router=router, **options)
    if router == "noisy_topk":
        nn.init.normal_(plain.router.w_noise, std=0.5)  # make the noise matter
    ckpt = moe.MoELayer(16, 24, num_experts=6, top_k=k, router=router, recompute=True, **options)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(37, 16)
    y0, gx0, g0 = grads_of(plain, x, seed=3)
    y1, gx1, g1 = grads_of(ckpt, x, seed=3)
    assert torch.equal(y0, y1)
    torch.testing.assert_close(gx0, gx1, rtol=0, atol=1e-6)
    assert g0.keys() == g1.keys() and "router.weight" in g0
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=0, atol=1e-6, msg=name)
    # Different seeds do route differently: the equality above is not vacuous.
    if router != "topk":
        y2, _, _ = grads_of(plain, x, seed=4)
        assert not torch.equal(y0, y2)


def test_recompute_blocks_wraps_blocks_and_keeps_gradients():
    cfg = TinyConfig(
        n_layers=3, d_model=32, n_heads=4, d_ff=64, seq_len=16, router="gshard", capacity_factor=1.0
    )
    torch.manual_seed(0)
    plain = cfg.build()
    ckpt = copy.deepcopy(plain)
    assert find_repeated_blocks(plain) == ["blocks.0", "blocks.1", "blocks.2"]
    assert recompute_blocks(ckpt) == ["blocks.0", "blocks.1", "blocks.2"]
    assert recompute_blocks(ckpt) == ["blocks.0", "blocks.1", "blocks.2"]  # idempotent
    assert ckpt.state_dict().keys() == plain.state_dict().keys()
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    results = []
    for model in (plain, ckpt):
        torch.manual_seed(7)
        loss = loss_of(model, tokens)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=0, atol=1e-6, msg=name)
    # Fewer activations kept between forward and backward.
    torch.manual_seed(7)
    full = measured_activation_bytes(plain, tokens)
    torch.manual_seed(7)
    kept = measured_activation_bytes(ckpt, tokens)
    assert kept < 0.5 * full, (kept, full)
    ckpt.eval()
    with torch.no_grad():
        assert torch.equal(ckpt(tokens), plain.eval()(tokens))


def test_recompute_blocks_needs_repeated_blocks():
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        recompute_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match="no module named"):
        recompute_blocks(nn.Sequential(nn.Linear(2, 2)), names=["missing"])
