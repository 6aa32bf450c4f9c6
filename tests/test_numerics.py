"""Numerics: float64 everywhere (gradcheck of the whole layer, inputs and every parameter),
the router in float32 under autocast, and the check_finite debug mode."""

import pytest
import torch
from torch.autograd import gradcheck
from torch.func import functional_call

import moe

CASES = [
    dict(),
    dict(activation="swiglu", bias=True),
    dict(capacity_factor=0.5, drop_policy="probs"),
    dict(router="expert_choice"),
    dict(score_func="sigmoid", normalize_weights=True, num_groups=2, topk_groups=1),
    dict(router="prototype"),
    dict(d_model=16, d_ff=32),  # 16-byte aligned widths: the torch._grouped_mm path for fp32
]


@pytest.mark.parametrize("options", CASES, ids=[str(c) for c in CASES])
def test_layer_gradcheck_float64(options):
    torch.manual_seed(0)
    kw = dict(d_model=6, d_ff=10, num_experts=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.1)
    layer = moe.MoELayer(**{**kw, **options}).double()
    d = layer.config.d_model
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in layer.named_parameters())
    x = torch.randn(7, d, dtype=torch.float64, requires_grad=True)

    def f(x, *ps):
        y = functional_call(layer, dict(zip(names, ps)), (x,))
        assert y.dtype == torch.float64
        return y, layer.aux_loss

    assert gradcheck(f, (x, *params), fast_mode=True)


def test_router_runs_in_float32_under_autocast():
    torch.manual_seed(0)
    layer = moe.MoELayer(64, 32, 16, top_k=4)
    x = torch.randn(256, 64)
    reference = layer.router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routed = layer.router(x)
        y = layer(x)
    assert routed.logits_TE.dtype == torch.float32
    assert torch.equal(routed.expert_ids_TK, reference.expert_ids_TK)
    torch.testing.assert_close(routed.weights_TK, reference.weights_TK)
    assert torch.isfinite(y.float()).all()


def test_check_finite_names_the_layer_and_expert():
    torch.manual_seed(0)
    layer = moe.MoELayer(8, 16, 4, top_k=2, check_finite=True, name="blocks.1.mlp")
    x = torch.randn(6, 8)
    layer(x)  # finite: no error
    with torch.no_grad():
        layer.experts.w2[2, 3, 1] = float("nan")
    with pytest.raises(FloatingPointError, match=r"blocks\.1\.mlp.*expert\(s\) \[2\]"):
        layer(x)
    quiet = moe.MoELayer(8, 16, 4, top_k=2)  # off by default: NaN flows through, no error
    with torch.no_grad():
        quiet.experts.w2.fill_(float("inf"))
    quiet(x)
