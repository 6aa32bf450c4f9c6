"""Router replay: a replayed forward equals the recorded one bit for bit (outputs, gradients);
replay forces the recorded experts after the router changed; capacity follows the replayed
choice; routes round-trip through safetensors; mismatches are errors naming the layer; works
through from_hf models and under expert parallelism on gloo ranks."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import moe
from moe.dispatch.permute import token_choice_rows
from tests.distributed import run_ranks

D, F, E = 10, 14, 6

ROUTERS = [
    {},
    {"softmax_before_topk": False, "top_k": 3},
    {"score_func": "sigmoid", "normalize_weights": True, "route_scale": 2.5},
    {"score_func": "sigmoid", "num_groups": 3, "topk_groups": 2, "top_k": 3, "expert_bias": True},
    {"router": "switch", "top_k": 1, "jitter_eps": 0.1},
    {"router": "gshard"},
    {"router": "noisy_topk"},
    {"router": "prototype", "top_k": 3},
    {"capacity_factor": 0.6, "min_capacity": 1},
    {"capacity_factor": 0.6, "min_capacity": 1, "drop_policy": "probs", "recompute": True},
]


def build(seed=0, **options):
    torch.manual_seed(seed)
    options = {"top_k": 2, **options}
    bias_expert = options.pop("expert_bias", False)
    model = nn.Sequential(
        nn.Linear(D, D),
        moe.MoELayer(D, F, E, name="a", **options),
        nn.Linear(D, D),
        moe.MoELayer(D, F, E, name="b", **options),
    )
    if bias_expert:  # a non-zero aux-loss-free bias that changes the choice
        for _, layer in moe.moe_layers(model):
            layer.router.expert_bias.uniform_(-0.3, 0.3)
    if options.get("router") == "gshard":  # peaked scores: random routing declines some
        for _, layer in moe.moe_layers(model):
            layer.router.weight.data.mul_(6.0)
    if options.get("router") == "noisy_topk":
        for _, layer in moe.moe_layers(model):
            nn.init.normal_(layer.router.w_noise, std=0.3)
    return model


def run(model, x, seed):
    """Forward + backward with a fixed seed (jitter, noise, random routing); outputs, grads."""
    torch.manual_seed(seed)
    y = model(x)
    loss = y.square().mean() + moe.aux_loss(model)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return y.detach(), grads


def assert_same(a, b):
    (ya, ga), (yb, gb) = a, b
    assert torch.equal(ya, yb)
    for x, y in zip(ga, gb):
        assert (x is None and y is None) or torch.equal(x, y)


def ids(routes):
    return {n: [r.expert_ids_TK for r in records] for n, records in routes.layers.items()}


@pytest.mark.parametrize("options", ROUTERS, ids=lambda o: ",".join(map(str, o.values())) or "")
def test_replayed_forward_equals_recorded_bit_for_bit(options):
    model = build(**options).train()
    xs = [torch.randn(13, D), torch.randn(3, 5, D)]  # several forwards, different sizes
    with moe.record_routing(model) as routes:
        recorded = [run(model, x, seed=i) for i, x in enumerate(xs)]
    assert [len(r) for r in routes.layers.values()] == [2, 2]
    assert routes["1"][1].expert_ids_TK.shape == (15, model[1].config.top_k)
    with moe.record_routing(model) as again, moe.replay_routing(model, routes):
        for i, x in enumerate(xs):
            # gshard: another seed, same result (random routing's draw is replayed)
            replayed = run(model, x, seed=i + 100 * (options.get("router") == "gshard"))
            assert_same(replayed, recorded[i])
    for a, b in zip(ids(again).values(), ids(routes).values()):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert model[1].route_replay is None and model[1].route_recorder is None


@pytest.mark.parametrize("options", ROUTERS[:8], ids=lambda o: ",".join(map(str, o.values())))
def test_replay_forces_recorded_experts_after_router_changes(options):
    model = build(**options).eval()
    x = torch.randn(17, D)
    with moe.record_routing(model) as routes:
        y_recorded = model(x)
    with torch.no_grad():
        for _, layer in moe.moe_layers(model):
            layer.router.weight.copy_(torch.randn_like(layer.router.weight))
    with moe.record_routing(model) as free:
        model(x)
    assert not all(
        torch.equal(a[0], b[0]) for a, b in zip(ids(free).values(), ids(routes).values())
    )
    with moe.record_routing(model) as forced, moe.replay_routing(model, routes):
        model(x)
    for name, records in routes.layers.items():
        got = forced[name][0]
        assert torch.equal(got.expert_ids_TK, records[0].expert_ids_TK)
        assert not torch.equal(got.weights_TK, records[0].weights_TK)  # the router's new weights
    # recorded weights too: the whole forward is the recorded one (experts are unchanged)
    with moe.replay_routing(model, routes, weights=True):
        assert torch.equal(model(x), y_recorded)


def test_replayed_weights_are_the_routers_own_and_carry_gradients():
    model = build(score_func="sigmoid", normalize_weights=True, route_scale=2.0).train()
    x = torch.randn(11, D)
    with moe.record_routing(model) as routes:
        model(x)
    layer = model[1]
    with torch.no_grad():
        layer.router.weight.add_(torch.randn_like(layer.router.weight))
    with moe.record_routing(model) as forced, moe.replay_routing(model, routes):
        model(x).sum().backward()
    ids_TK = routes["1"][0].expert_ids_TK
    x_TD = model[0](x).double()
    s_TK = (x_TD @ layer.router.weight.double().t()).sigmoid().gather(1, ids_TK)
    expected_TK = 2.0 * s_TK / s_TK.sum(-1, keepdim=True)
    torch.testing.assert_close(forced["1"][0].weights_TK.double(), expected_TK)
    assert layer.router.weight.grad.abs().sum() > 0
    layer.router.weight.grad = None
    with moe.replay_routing(model, routes, weights=True):  # weights fixed: only the aux loss
        model(x).sum().backward()
    assert layer.router.weight.grad is None or not layer.router.weight.grad.any()


def test_capacity_and_drops_follow_the_recorded_choice():
    model = build(capacity_factor=0.5, min_capacity=1, aux_loss_coef=0.0).train()
    x = torch.randn(19, D)
    with moe.record_routing(model) as routes:
        model(x)
    recorded_stats = {n: dict(layer.stats) for n, layer in moe.moe_layers(model)}
    with torch.no_grad():
        for _, layer in moe.moe_layers(model):
            layer.router.weight.copy_(torch.randn_like(layer.router.weight) * 3)
    model(x)
    assert any(
        not torch.equal(layer.stats["routed_per_expert"], recorded_stats[n]["routed_per_expert"])
        for n, layer in moe.moe_layers(model)
    )
    with moe.replay_routing(model, routes):
        model(x)
    for name, layer in moe.moe_layers(model):
        record = routes[name][0]
        capacity = -(-19 * 2 // 2 // E)  # ceil(0.5 * 2 * 19 / 6) = 4
        plan = token_choice_rows(record.expert_ids_TK, record.weights_TK, E, capacity)
        assert torch.equal(layer.stats["tokens_per_expert"], plan.counts_E)
        assert torch.equal(layer.stats["dropped"], plan.num_dropped)
        assert plan.num_dropped > 0
        for key in ("tokens_per_expert", "routed_per_expert", "dropped"):
            assert torch.equal(layer.stats[key], recorded_stats[name][key])


def test_routes_round_trip_through_safetensors(tmp_path):
    model = build(router="gshard").train()  # declined second experts are recorded as ~e
    x = torch.randn(9, D)
    with moe.record_routing(model) as routes:
        recorded = run(model, x, seed=3)
    assert any((r[0].expert_ids_TK < 0).any() for r in routes.layers.values())
    path = routes.save(tmp_path / "routes-{rank}.safetensors")
    assert path == tmp_path / "routes-0.safetensors"
    loaded = moe.Routes.load(tmp_path / "routes-{rank}.safetensors")
    assert list(loaded.layers) == ["1", "3"]
    with moe.replay_routing(model, loaded):
        assert_same(run(model, x, seed=3), recorded)


def _error(model, routes, match, **kwargs):
    with pytest.raises(ValueError, match=match), moe.replay_routing(model, routes, **kwargs):
        pass
    assert all(layer.route_replay is None for _, layer in moe.moe_layers(model))


def test_mismatches_are_errors_naming_the_layer(tmp_path):
    model = build()
    x = torch.randn(7, D)
    with moe.record_routing(model) as routes:
        model(x)
    r = routes["3"][0]
    bad = moe.Routes({"1": routes["1"]})
    _error(model, bad, "^3: the routes have no records")
    _error(model, moe.Routes({**routes.layers, "9": []}), "^9: the routes name a layer")
    _error(build(top_k=3), routes, "^1: forward 0: recorded k=2, the layer has 3")
    out_of_range = r.expert_ids_TK.clone()
    out_of_range[5, 1] = E
    _error(
        model,
        moe.Routes(
            {"1": routes["1"], "3": [moe.trace.replay.RouteRecord(out_of_range, r.weights_TK)]}
        ),
        r"^3: forward 0: an expert id is outside \[0, 6\)",
    )
    proto = build(router="prototype", top_k=2)
    with moe.record_routing(proto) as proto_routes:
        proto(x)
    swapped = proto_routes["3"][0].expert_ids_TK.flip(1)
    wrong = moe.Routes(
        {**proto_routes.layers, "3": [moe.trace.replay.RouteRecord(swapped, r.weights_TK)]}
    )
    _error(proto, wrong, "^3: forward 0: choice j of a token must be an expert of prototype j")
    with (
        moe.replay_routing(model, routes),
        pytest.raises(ValueError, match="^1: forward 0 was recorded with 7 tokens, got 8"),
    ):
        model(torch.randn(8, D))
    with moe.replay_routing(model, routes):
        model(x)
        with pytest.raises(ValueError, match="^1: routes hold 1 forward.*forward 2 has no record"):
            model(x)
    ec = build(router="expert_choice", capacity_factor=1.0)
    with (
        pytest.raises(ValueError, match="^1: router='expert_choice'.*not supported"),
        moe.record_routing(ec),
    ):
        pass
    # files: wrong dtype, missing tensor, not a routes file
    tensors = {
        "1/0/expert_ids_TK": routes["1"][0].expert_ids_TK.int(),
        "1/0/weights_TK": r.weights_TK,
    }
    meta = {"format": "moe.routes/1", "layers": '{"1": 1}'}
    save_file(tensors, tmp_path / "dtype.safetensors", metadata=meta)
    with pytest.raises(ValueError, match="layer '1', forward 0: expert_ids_TK must be int64"):
        moe.Routes.load(tmp_path / "dtype.safetensors")
    save_file(tensors, tmp_path / "count.safetensors", metadata={**meta, "layers": '{"1": 2}'})
    with pytest.raises(ValueError, match="the layer list names 4 tensors, the file holds 2"):
        moe.Routes.load(tmp_path / "count.safetensors")
    save_file(tensors, tmp_path / "name.safetensors", metadata={**meta, "layers": '{"2": 1}'})
    with pytest.raises(ValueError, match="tensor '1/0/expert_ids_TK' is unexpected"):
        moe.Routes.load(tmp_path / "name.safetensors")
    tensors["1/0/weights_TK"] = r.weights_TK[:, :1].contiguous()
    tensors["1/0/expert_ids_TK"] = routes["1"][0].expert_ids_TK
    save_file(tensors, tmp_path / "shape.safetensors", metadata=meta)
    with pytest.raises(ValueError, match="layer '1', forward 0: weights_TK must be float"):
        moe.Routes.load(tmp_path / "shape.safetensors")
    save_file(tensors, tmp_path / "plain.safetensors")
    with pytest.raises(ValueError, match="not a routes file"):
        moe.Routes.load(tmp_path / "plain.safetensors")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_replay_through_from_hf(family):
    pytest.importorskip("transformers")
    from tests.test_hf_parity import fresh

    model = moe.from_hf(fresh(family)).train()
    tokens = torch.randint(0, 97, (2, 9))
    with moe.record_routing(model) as routes:
        torch.manual_seed(0)
        recorded = model(tokens).logits
        recorded.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert len(routes.layers) == 3
    with moe.replay_routing(model, routes):
        torch.manual_seed(0)
        replayed = model(tokens).logits
        replayed.square().mean().backward()
    assert torch.equal(replayed, recorded)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    with torch.no_grad():
        for _, layer in moe.moe_layers(model):
            layer.router.weight.copy_(torch.randn_like(layer.router.weight))
    with moe.record_routing(model) as forced, moe.replay_routing(model, routes):
        model(tokens)
    for name, records in routes.layers.items():
        assert torch.equal(forced[name][0].expert_ids_TK, records[0].expert_ids_TK)


def _grads(model):
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for p in model.parameters()]  # fmt: skip


def _ep_body(rank, world, path):
    from moe.parallel import init_mesh, parallelize

    model = parallelize(build(capacity_factor=1.0), init_mesh(dp=1, ep=world)).train()
    torch.manual_seed(10 + rank)  # each rank its own tokens, and a different count
    x = torch.randn(7 + 4 * rank, D)
    with moe.record_routing(model) as routes:
        y = model(x)
        y.square().sum().backward()
    grads = _grads(model)
    model.zero_grad()
    routes.save(path)
    loaded = moe.Routes.load(path)
    with moe.replay_routing(model, loaded):  # bit for bit, outputs and gradients
        y1 = model(x)
        y1.square().sum().backward()
    same = torch.equal(y1, y) and all(torch.equal(a, b) for a, b in zip(_grads(model), grads))
    with torch.no_grad():  # the same new router on every rank
        torch.manual_seed(99)
        for _, layer in moe.moe_layers(model):
            layer.router.weight.copy_(torch.randn_like(layer.router.weight))
    with moe.record_routing(model) as forced, moe.replay_routing(model, loaded, weights=True):
        y2 = model(x)
    same_ids = all(
        torch.equal(forced[n][0].expert_ids_TK, routes[n][0].expert_ids_TK) for n in routes.layers
    )
    return same, torch.equal(y2, y), same_ids


def test_replay_under_expert_parallelism(tmp_path):
    results = run_ranks(_ep_body, 2, str(tmp_path / "routes-{rank}.safetensors"), timeout=60)
    assert results == [(True, True, True), (True, True, True)]
    assert (tmp_path / "routes-0.safetensors").exists()
    assert (tmp_path / "routes-1.safetensors").exists()
    a = moe.Routes.load(tmp_path / "routes-0.safetensors")
    b = moe.Routes.load(tmp_path / "routes-1.safetensors")
    assert a["1"][0].expert_ids_TK.shape[0] == 7 and b["1"][0].expert_ids_TK.shape[0] == 11
