"""Every router against a naive per-token float64 reference."""

import math

import pytest
import torch

from moe import MoEConfig
from moe.gating import build_router
from tests import reference as ref


def make_router(seed=0, **options):
    torch.manual_seed(seed)
    base = {"d_model": 12, "d_ff": 8, "num_experts": 6, "top_k": 2}
    config = MoEConfig(**{**base, **options})
    return build_router(config).eval(), config


def logits64(router, x):
    return x.double() @ router.weight.double().t()


TOPK_CASES = [
    {},
    {"top_k": 1},
    {"top_k": 3, "normalize_weights": True},
    {"softmax_before_topk": False},
    {"score_func": "sigmoid", "normalize_weights": True, "route_scale": 2.5},
    {"score_func": "sigmoid", "num_groups": 3, "topk_groups": 2, "top_k": 3},
    {"num_groups": 2, "topk_groups": 1},
]


@pytest.mark.parametrize("options", TOPK_CASES)
def test_topk_router_matches_reference(options):
    router, c = make_router(**options)
    with torch.no_grad():
        router.expert_bias.uniform_(-0.1, 0.1)
    x = torch.randn(9, 12)
    routing = router(x)
    logits = logits64(router, x)
    for t in range(9):
        ids, weights = ref.topk_route(
            logits[t],
            c.top_k,
            c.score_func,
            c.softmax_before_topk,
            c.normalize_weights,
            c.route_scale,
            router.expert_bias,
            c.num_groups,
            c.topk_groups,
        )
        assert routing.expert_ids_TK[t].tolist() == ids
        torch.testing.assert_close(routing.weights_TK[t].double(), weights, rtol=1e-5, atol=1e-6)
    assert routing.logits_TE.dtype == torch.float32
    probs = (
        logits.softmax(-1)
        if c.score_func == "softmax"
        else (logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True))
    )
    expected = c.aux_loss_coef * ref.load_balance(probs, routing.expert_ids_TK.tolist())
    torch.testing.assert_close(
        routing.aux_loss.double(), torch.as_tensor(expected).double(), rtol=1e-5, atol=1e-7
    )


def test_router_math_is_fp32_for_bf16_input():
    router, _ = make_router()
    x = torch.randn(5, 12).bfloat16()
    routing = router(x)
    assert routing.logits_TE.dtype == torch.float32
    assert routing.weights_TK.dtype == torch.float32
    torch.testing.assert_close(routing.logits_TE, x.float() @ router.weight.t())


def test_z_loss_and_coefficients():
    router, c = make_router(aux_loss_coef=0.0, z_loss_coef=1e-3)
    x = torch.randn(7, 12) * 3
    routing = router(x)
    expected = 1e-3 * ref.z_loss(logits64(router, x))
    torch.testing.assert_close(routing.aux_loss.double(), expected, rtol=1e-5, atol=1e-8)


def test_switch_is_top1_raw_prob_with_jitter_only_in_training():
    router, c = make_router(router="switch", top_k=1, jitter_eps=0.1)
    x = torch.randn(8, 12)
    routing = router(x)
    probs = logits64(router, x).softmax(-1)
    assert routing.expert_ids_TK[:, 0].tolist() == probs.argmax(-1).tolist()
    torch.testing.assert_close(routing.weights_TK[:, 0].double(), probs.max(-1).values)
    router.train()
    torch.manual_seed(5)
    noisy = router(x)
    torch.manual_seed(5)
    jitter = torch.empty_like(x).uniform_(0.9, 1.1)
    expected = (x * jitter).double() @ router.weight.double().t()
    torch.testing.assert_close(noisy.logits_TE.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(noisy.logits_TE, routing.logits_TE)
    with pytest.raises(ValueError, match="top-1"):
        MoEConfig(d_model=4, d_ff=4, num_experts=4, top_k=2, router="switch")


def test_gshard_second_expert_random_routing():
    router, c = make_router(router="gshard")
    x = torch.randn(400, 12)
    probs = logits64(router, x).softmax(-1)
    top = probs.topk(2, dim=-1)
    gates = top.values / top.values.sum(-1, keepdim=True)
    routing = router(x)  # eval: both experts always dispatched
    assert routing.expert_ids_TK.tolist() == top.indices.tolist()
    torch.testing.assert_close(routing.weights_TK.double(), gates)
    assert routing.mask_TK.all()
    top1 = top.indices[:, :1].tolist()
    torch.testing.assert_close(
        routing.aux_loss.double(), torch.as_tensor(c.aux_loss_coef * ref.load_balance(probs, top1))
    )
    router.train()
    torch.manual_seed(3)
    trained = router(x)
    torch.manual_seed(3)
    u = torch.rand(400)
    expected_keep = (u.double() < 2 * gates[:, 1]).tolist()
    assert trained.mask_TK[:, 1].tolist() == expected_keep
    assert trained.mask_TK[:, 0].all()
    assert (trained.weights_TK[:, 1][~trained.mask_TK[:, 1]] == 0).all()
    assert 0 < sum(expected_keep) < 400


def test_noisy_topk_eval_and_losses():
    router, c = make_router(router="noisy_topk", top_k=2)
    x = torch.randn(10, 12)
    routing = router(x)
    logits = logits64(router, x)
    importance = torch.zeros(6, dtype=torch.float64)
    load = torch.zeros(6, dtype=torch.float64)
    for t in range(10):
        ids, weights = ref.topk_route(logits[t], 2, softmax_before_topk=False)
        assert routing.expert_ids_TK[t].tolist() == ids
        torch.testing.assert_close(routing.weights_TK[t].double(), weights)
        importance[ids] += weights
        load[ids] += 1

    def cv2(v):
        return v.var() / (v.mean() ** 2 + 1e-10)

    torch.testing.assert_close(
        routing.aux_loss.double(), c.aux_loss_coef * (cv2(importance) + cv2(load))
    )
    router.train()
    with torch.no_grad():
        router.w_noise.normal_()
    trained = router(x)
    trained.aux_loss.backward()
    assert router.w_noise.grad.abs().sum() > 0  # the smooth load estimator trains the noise


def test_expert_choice_each_expert_takes_its_top_tokens():
    router, c = make_router(router="expert_choice", capacity_factor=1.5)
    x = torch.randn(10, 12)
    routing = router(x)
    probs = logits64(router, x).softmax(-1)
    C = math.ceil(1.5 * 10 / 6)
    assert routing.token_ids_EC.shape == (6, C)
    for e in range(6):
        best = sorted(range(10), key=lambda t: -probs[t, e].item())[:C]
        assert routing.token_ids_EC[e].tolist() == best
        torch.testing.assert_close(routing.weights_EC[e].double(), probs[best, e])
    assert routing.aux_loss.item() == 0.0
    big, _ = make_router(router="expert_choice", capacity_factor=50.0)
    assert big(x).token_ids_EC.shape == (6, 10)  # capacity > tokens is clamped, no crash


def test_prototype_top1_in_each_group():
    router, c = make_router(router="prototype", top_k=3)
    x = torch.randn(11, 12)
    routing = router(x)
    logits = logits64(router, x)
    balance = 0.0
    for g in range(3):
        probs_g = logits[:, 2 * g : 2 * g + 2].softmax(-1)
        best = probs_g.argmax(-1)
        assert (routing.expert_ids_TK[:, g] == best + 2 * g).all()
        torch.testing.assert_close(routing.weights_TK[:, g].double(), probs_g.max(-1).values)
        balance += ref.load_balance(probs_g, best.unsqueeze(1).tolist()) / 3
    torch.testing.assert_close(
        routing.aux_loss.double(), torch.as_tensor(c.aux_loss_coef * balance).double()
    )
    with pytest.raises(ValueError, match="prototype"):
        MoEConfig(d_model=4, d_ff=4, num_experts=7, top_k=2, router="prototype")


def test_bias_balancing_moves_toward_underloaded_and_is_saved():
    router, _ = make_router(score_func="sigmoid", normalize_weights=True, bias_update_rate=0.01)
    load = torch.tensor([10.0, 0.0, 3.0, 3.0, 5.0, 9.0])
    router.update_bias(load)
    bias = router.expert_bias
    assert bias[1] > 0 and bias[0] < 0 and bias[5] < 0
    torch.testing.assert_close(bias.sum(), torch.tensor(0.0), atol=1e-7, rtol=0)
    assert "expert_bias" in router.state_dict()
    with torch.no_grad():
        bias.copy_(torch.tensor([0.0, 10.0, 0, 0, 0, 0]))
    ids = router(torch.randn(5, 12)).expert_ids_TK
    assert (ids == 1).any(dim=1).all()  # the bias steers the choice, the weights ignore it
    routing = router(torch.randn(5, 12))
    scores = routing.logits_TE.sigmoid().gather(1, routing.expert_ids_TK)
    torch.testing.assert_close(routing.weights_TK, scores / scores.sum(-1, keepdim=True))
