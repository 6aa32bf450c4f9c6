"""MoELayer against a per-token float64 loop: outputs and every gradient."""

import pytest
import torch

import moe
from moe.dispatch import expert_capacity
from tests import reference as ref
from tests.tolerance import assert_close_in


def layer_params(layer: moe.MoELayer) -> dict[str, torch.Tensor]:
    """The router and expert parameters the reference differentiates, by short name."""
    ex = layer.experts
    named = {"router": layer.router.weight, "w1": ex.w1, "w2": ex.w2, "w3": ex.w3, "b1": ex.b1,
             "b2": ex.b2}  # fmt: skip
    return {n: p for n, p in named.items() if p is not None}


def reference_layer(layer: moe.MoELayer, x_TD: torch.Tensor):
    """Per-token float64 forward of `layer` with its own weights (differentiable copies)."""
    c = layer.config
    params = {
        n: p.detach().double().clone().requires_grad_() for n, p in layer_params(layer).items()
    }
    x = x_TD.detach().double().clone().requires_grad_()
    logits = x @ params["router"].t()
    routes = [
        ref.topk_route(
            logits[t],
            c.top_k,
            c.score_func,
            c.softmax_before_topk,
            c.normalize_weights,
            c.route_scale,
        )
        for t in range(x.shape[0])
    ]
    ids = [r[0] for r in routes]
    capacity = expert_capacity(
        x.shape[0], c.num_experts, c.top_k, c.capacity_factor, c.min_capacity
    )
    keep = ref.keep_mask(
        ids, [r[1].detach() for r in routes], c.num_experts, capacity, c.drop_policy
    )
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros(c.d_model, dtype=torch.float64)
        for j, e in enumerate(ids[t]):
            if keep[t][j]:
                out = ref.expert_ffn(
                    x[t],
                    e,
                    params["w1"],
                    params["w2"],
                    params.get("w3"),
                    params.get("b1"),
                    params.get("b2"),
                    c.activation,
                )
                y = y + routes[t][1][j] * out
        rows.append(y)
    y = torch.stack(rows) if rows else torch.zeros(0, c.d_model, dtype=torch.float64)
    return y, x, params, sum(1 for t in keep for k in t if not k)


def check_against_reference(layer, x, rtol=1e-4, atol=1e-5):
    x = x.clone().requires_grad_()
    y = layer(x)
    g = torch.randn(y.shape, dtype=torch.float64, device=y.device)
    (y.double() * g).sum().backward()
    y_ref, x_ref, params, dropped = reference_layer(layer, x.reshape(-1, x.shape[-1]))
    (y_ref * g.reshape(y_ref.shape)).sum().backward()
    torch.testing.assert_close(y.double().reshape(y_ref.shape), y_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(
        x.grad.double().reshape(x_ref.shape), x_ref.grad, rtol=rtol, atol=atol
    )
    for name, p in layer_params(layer).items():
        torch.testing.assert_close(
            p.grad.double(),
            params[name].grad,
            rtol=rtol,
            atol=atol,
            msg=lambda m, name=name: f"grad of {name}: {m}",
        )
    assert layer.stats["dropped"].item() == dropped
    return y


CASES = [
    dict(T=23, E=5, k=2, cf=None, D=16, F=24, activation="gelu"),
    dict(T=23, E=5, k=2, cf=0.6, D=16, F=24, activation="relu", drop_policy="position"),
    dict(T=19, E=4, k=3, cf=0.8, D=10, F=6, activation="silu", drop_policy="probs"),
    dict(T=1, E=3, k=1, cf=1.0, D=8, F=12, activation="gelu_tanh"),
    dict(T=13, E=6, k=2, cf=None, D=12, F=20, activation="swiglu", normalize_weights=True),
    dict(T=9, E=4, k=2, cf=1.25, D=16, F=8, activation="gelu", bias=True),
    dict(T=31, E=7, k=1, cf=None, D=9, F=5, activation="relu", bias=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_layer_matches_per_token_reference(case):
    case = dict(case)
    torch.manual_seed(case["T"] * 31 + case["E"])
    T, D = case.pop("T"), case.pop("D")
    layer = moe.MoELayer(
        D, case.pop("F"), case.pop("E"), top_k=case.pop("k"), capacity_factor=case.pop("cf"), **case
    )
    check_against_reference(layer, torch.randn(3, T, D)[1])


def test_all_tokens_to_one_expert_and_empty_experts_get_zero_grads():
    torch.manual_seed(1)
    layer = moe.MoELayer(8, 12, 6, top_k=1)
    with torch.no_grad():
        layer.router.weight.fill_(-1.0)
        layer.router.weight[4] = 1.0
    x = torch.rand(11, 8) + 0.1  # positive: expert 4 wins every token
    check_against_reference(layer, x)
    assert layer.stats["tokens_per_expert"].tolist() == [0, 0, 0, 0, 11, 0]
    assert layer.stats["dead_experts"].item() == 5
    for w in (layer.experts.w1, layer.experts.w2):
        assert torch.equal(w.grad[[0, 1, 2, 3, 5]], torch.zeros_like(w.grad[[0, 1, 2, 3, 5]]))
        assert w.grad[4].abs().sum() > 0


def test_capacity_drops_are_counted_and_contribute_zero():
    torch.manual_seed(2)
    layer = moe.MoELayer(8, 8, 4, top_k=2, capacity_factor=0.5, min_capacity=1)
    x = torch.randn(40, 8)
    check_against_reference(layer, x)
    dropped = layer.stats["dropped"].item()
    assert dropped > 0
    assert layer.stats["dropped_fraction"].item() == pytest.approx(dropped / 80)
    assert layer.stats["tokens_per_expert"].sum().item() == 80 - dropped


def test_bf16_input_and_bf16_layer():
    """bf16 outputs and every gradient within a few bf16 eps of the values' scale (a 10 %
    error is ~13 eps): a float32 layer on bf16 input against itself on float32 input, then a
    bf16 layer against the float64 reference with its weights."""
    torch.manual_seed(3)
    layer = moe.MoELayer(16, 32, 4, top_k=2)
    x = torch.randn(2, 7, 16)
    y32 = layer(x)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert_close_in(torch.bfloat16, y, y32, msg="bf16 input")
    layer_bf16 = moe.MoELayer(16, 32, 4, top_k=2).bfloat16()
    xb = torch.randn(13, 16).bfloat16()
    yb = layer_bf16(xb.requires_grad_())
    g = torch.randn(13, 16, dtype=torch.float64)
    (yb.double() * g).sum().backward()
    y_ref, x_ref, params, _ = reference_layer(layer_bf16, xb)
    (y_ref * g).sum().backward()
    assert_close_in(torch.bfloat16, yb, y_ref, msg="y")
    assert xb.grad.dtype == torch.bfloat16
    assert_close_in(torch.bfloat16, xb.grad, x_ref.grad, msg="dx")
    for name, p in layer_params(layer_bf16).items():
        assert p.grad.dtype == torch.bfloat16
        assert_close_in(torch.bfloat16, p.grad, params[name].grad, msg=f"d{name}")


def test_expert_choice_layer_matches_reference():
    torch.manual_seed(4)
    layer = moe.MoELayer(8, 12, 4, top_k=2, router="expert_choice", capacity_factor=1.0)
    x = torch.randn(10, 8, requires_grad=True)
    y = layer(x)
    g = torch.randn(10, 8)
    (y * g).sum().backward()
    ex = layer.experts
    w1, w2 = ex.w1.detach().double().requires_grad_(), ex.w2.detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    probs = (x64 @ layer.router.weight.detach().double().t()).softmax(-1)
    y_ref = torch.zeros(10, 8, dtype=torch.float64)
    C = 3  # ceil(1.0 * 10 / 4)
    for e in range(4):
        for t in sorted(range(10), key=lambda t: -probs[t, e].item())[:C]:
            y_ref[t] += probs[t, e] * ref.expert_ffn(x64[t], e, w1, w2)
    (y_ref * g.double()).sum().backward()
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ex.w1.grad.double(), w1.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "router,k",
    [("switch", 1), ("gshard", 2), ("noisy_topk", 2), ("prototype", 2), ("expert_choice", 2)],
)
def test_every_router_trains_in_the_layer(router, k):
    torch.manual_seed(5)
    layer = moe.MoELayer(8, 16, 4, top_k=k, router=router, capacity_factor=1.5)
    x = torch.randn(2, 9, 8)
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert layer.router.weight.grad.abs().sum() > 0
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))  # no noise in eval


def test_eval_capacity_factor():
    layer = moe.MoELayer(
        8, 8, 4, top_k=1, capacity_factor=0.25, eval_capacity_factor=4.0, min_capacity=1
    )
    x = torch.randn(64, 8)
    layer(x)
    assert layer.stats["dropped"].item() > 0
    layer.eval()
    layer(x)
    assert layer.stats["dropped"].item() == 0


def test_empty_input_returns_empty_output_with_gradients():
    layer = moe.MoELayer(8, 8, 4)
    x = torch.randn(0, 3, 8, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 3, 8)
    (y.sum() + layer.aux_loss).backward()
    assert x.grad.shape == x.shape
    assert torch.equal(layer.experts.w1.grad, torch.zeros_like(layer.experts.w1))


def test_bad_input_and_config_errors():
    layer = moe.MoELayer(8, 8, 4, name="blocks.3.mlp")
    with pytest.raises(ValueError, match=r"blocks.3.mlp.*\[\.\.\., 8\]"):
        layer(torch.randn(5, 7))
    with pytest.raises(ValueError, match="floating"):
        layer(torch.ones(5, 8, dtype=torch.long))
    x = torch.randn(5, 8)
    x[2, 3] = float("nan")
    with pytest.raises(FloatingPointError, match="blocks.3.mlp"):
        layer(x)
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        moe.MoELayer(8, 8, 4, top_k=5)
    for field, kwargs in [
        ("d_model", dict(d_model=0)),
        ("d_ff", dict(d_ff=-2)),
        ("num_experts", dict(num_experts=0)),
    ]:
        args = {"d_model": 8, "d_ff": 8, "num_experts": 4, **kwargs}
        with pytest.raises(ValueError, match=field):
            moe.MoELayer(**args)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe.MoELayer(8, 8, 4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="router='nope' is unknown"):
        moe.MoELayer(8, 8, 4, router="nope")
    with pytest.raises(ValueError, match="activation"):
        moe.MoELayer(8, 8, 4, activation="tanh")
    with pytest.raises(ValueError, match="drop_policy"):
        moe.MoELayer(8, 8, 4, drop_policy="random")


OVERFLOWING = [  # (field, value, message): refused at construction, not in forward
    ("capacity_factor", 1e308, "capacity_factor must be <= 10000"),
    ("capacity_factor", float("inf"), "capacity_factor must be a finite number"),
    ("capacity_factor", 10**400, "capacity_factor must be <= 10000"),
    ("eval_capacity_factor", 1e5, "eval_capacity_factor must be <= 10000"),
    ("eval_capacity_factor", float("nan"), "eval_capacity_factor must be a finite number"),
    ("jitter_eps", 1e308, "jitter_eps must be <= 1"),
    ("route_scale", 1e308, "route_scale must be <= 10000"),
    ("aux_loss_coef", 1e308, "aux_loss_coef must be <= 10000"),
    ("z_loss_coef", float("-inf"), "z_loss_coef must be a finite number"),
    ("bias_update_rate", 1e308, "bias_update_rate must be <= 1"),
    ("min_capacity", 10**400, "min_capacity must be <= 2147483647"),
    ("d_ff", 2**31, "d_ff must be <= 2147483647"),
]


@pytest.mark.parametrize("field, value, message", OVERFLOWING)
def test_overflowing_config_values_are_refused_at_construction(field, value, message):
    args = {"d_model": 8, "d_ff": 8, "num_experts": 4}
    router = {"router": "switch", "top_k": 1} if field == "jitter_eps" else {}
    with pytest.raises(ValueError, match=message):
        moe.MoELayer(**{**args, **router, field: value})


def test_largest_allowed_values_run_forward():
    """At the bounds every option still gives a finite forward (capacity = all tokens)."""
    layer = moe.MoELayer(
        8, 8, 4, top_k=1, router="switch", capacity_factor=1e4, eval_capacity_factor=1e4,
        jitter_eps=1.0, route_scale=1e4, aux_loss_coef=1e4, bias_update_rate=1.0,
        min_capacity=2**31 - 1,
    )  # fmt: skip
    x = torch.randn(7, 8, requires_grad=True)
    y = layer(x)
    (y.sum() + layer.aux_loss).backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert expert_capacity(7, 4, 1, 1e308) == 7 and expert_capacity(7, 4, 1, float("inf")) == 7


def test_aux_loss_sums_layers_and_is_weighted():
    model = torch.nn.Sequential(moe.MoELayer(8, 8, 4), moe.MoELayer(8, 8, 4, aux_loss_coef=0.5))
    model(torch.randn(6, 8))
    total = moe.aux_loss(model)
    torch.testing.assert_close(total, model[0].aux_loss + model[1].aux_loss)
    assert model[1].aux_loss > 10 * model[0].aux_loss  # 0.5 vs the default 1e-2
    assert [n for n, _ in moe.moe_layers(model)] == ["0", "1"]


def test_update_router_biases_uses_observed_load():
    layer = moe.MoELayer(8, 8, 4, top_k=1, score_func="sigmoid", bias_update_rate=0.1)
    layer(torch.randn(32, 8))
    load = layer.stats["routed_per_expert"].float()
    moe.update_router_biases(layer)
    expected = 0.1 * torch.sign(load.mean() - load)
    torch.testing.assert_close(layer.router.expert_bias, expected - expected.mean())


def test_determinism_same_seed_same_bits():
    def run():
        torch.manual_seed(7)
        layer = moe.MoELayer(16, 24, 5, top_k=2, capacity_factor=1.0, router="gshard")
        x = torch.randn(4, 9, 16, requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        return y, x.grad, layer.experts.w1.grad, layer.router.weight.grad

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)
