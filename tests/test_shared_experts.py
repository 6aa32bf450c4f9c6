"""Shared experts: every token's output is the routed sum plus a dense MLP (optionally scaled
by a sigmoid gate), checked per token in float64 against a naive loop, outputs and gradients."""

import pytest
import torch

import moe


def naive_shared(x_TD, shared) -> torch.Tensor:
    rows = []
    for x_D in x_TD:
        up = shared.up_proj.weight @ x_D
        if shared.gate_proj is not None:
            h = torch.nn.functional.silu(shared.gate_proj.weight @ x_D) * up
        else:
            h = torch.nn.functional.gelu(up)
        y = shared.down_proj.weight @ h
        if shared.gate is not None:
            y = torch.sigmoid(shared.gate.weight @ x_D) * y
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "options",
    [
        dict(activation="swiglu", num_shared_experts=2, shared_expert_gate=True),
        dict(activation="swiglu", num_shared_experts=1, shared_d_ff=7),
        dict(activation="gelu", num_shared_experts=1, capacity_factor=0.5),
    ],
)
def test_shared_experts_add_a_dense_mlp(options):
    torch.manual_seed(0)
    layer = moe.MoELayer(6, 10, 4, top_k=2, **options).double()
    c = layer.config
    assert layer.shared_experts.up_proj.weight.shape == (
        c.shared_d_ff or 10 * c.num_shared_experts,
        6,
    )
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    shared = layer.shared_experts
    layer.shared_experts = None  # the routed part alone
    routed = layer(x)
    layer.shared_experts = shared
    want = routed + naive_shared(x.reshape(-1, 6), shared).view_as(routed)
    torch.testing.assert_close(y, want)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *shared.parameters()], dy)
    want_grads = torch.autograd.grad(want, [x, *shared.parameters()], dy)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
    assert all(not moe.parallel.is_expert_parameter(layer, p) for p in shared.parameters())


def test_shared_expert_options_are_checked():
    with pytest.raises(ValueError, match="shared_expert_gate=True needs num_shared_experts > 0"):
        moe.MoELayer(6, 10, 4, shared_expert_gate=True)
    with pytest.raises(ValueError, match="num_shared_experts must be >= 0"):
        moe.MoELayer(6, 10, 4, num_shared_experts=-1)
