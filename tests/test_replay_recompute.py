"""Router replay under activation recompute (MoEConfig.recompute, recompute_blocks, a user's
own torch checkpoint with moe.recompute_context): a recompute replays the record its own
forward took, so gradients equal the run without recompute in float64, whatever the order of
forwards and backwards and with a forward whose output is dropped. A checkpoint without the
context is a RuntimeError, never a wrong record."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import moe

D, F, E = 8, 12, 5


class Block(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.moe = moe.MoELayer(D, F, E, top_k=2, backend="torch", **options)

    def forward(self, x):
        return x + self.moe(torch.tanh(self.proj(x)))


class Net(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.blocks = nn.ModuleList([Block(**options) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build(recompute: str) -> Net:
    torch.manual_seed(0)
    net = Net(recompute=recompute in ("layer", "nested")).double().train()
    if recompute in ("blocks", "nested"):  # nested: checkpointed layers in checkpointed blocks
        moe.memory.recompute_blocks(net)
    return net


def routes_and_inputs():
    """Records of 3 forwards on different inputs, then a router that would choose otherwise."""
    net = build("none")
    xs = [torch.randn(9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(3)]  # fmt: skip
    with moe.record_routing(net) as routes:
        for x in xs:
            net(x)
    return routes, xs


def perturbed(net: Net) -> Net:
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for _, layer in moe.moe_layers(net):
            layer.router.weight.add_(torch.randn(layer.router.weight.shape, generator=g).double())
    return net


def grads(loss, params, **kwargs):
    """Parameter gradients, zero where unused (the router with weights=True)."""
    out = torch.autograd.grad(loss, params, allow_unused=True, **kwargs)
    return tuple(torch.zeros_like(p) if g is None else g for p, g in zip(params, out))


def two_forwards_one_backward(net, xs):
    loss = net(xs[0]).square().mean() + net(xs[1]).sin().sum()
    return grads(loss, list(net.parameters()))


def dropped_forward(net, xs):
    net(xs[0])  # output dropped: still takes record 0
    loss = net(xs[1]).square().mean()
    return grads(loss, list(net.parameters()))


def backwards_in_reverse(net, xs):
    y0, y1, y2 = net(xs[0]), net(xs[1]), net(xs[2])
    g2 = grads(y2.sin().sum(), list(net.parameters()))
    g0 = grads(y0.square().mean(), list(net.parameters()))
    g1 = grads(y1.cos().sum(), list(net.parameters()))
    return g2 + g0 + g1


def twice_with_retained_graph(net, xs):
    net(xs[0])
    loss = net(xs[1]).square().mean()
    params = list(net.parameters())
    g = grads(loss, params, retain_graph=True)
    return g + grads(loss, params)


def assert_equal_grads(want, got):
    assert len(want) == len(got)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


SCENARIOS = [two_forwards_one_backward, dropped_forward, backwards_in_reverse]


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("scenario", SCENARIOS + [twice_with_retained_graph])
@pytest.mark.parametrize("recompute", ["layer", "blocks", "nested"])
def test_recompute_replays_its_own_forwards_record(recompute, scenario, weights):
    routes, xs = routes_and_inputs()
    results = {}
    for mode in ("none", recompute):
        net = perturbed(build(mode))
        with moe.replay_routing(net, routes, weights=weights):
            results[mode] = scenario(net, xs)
    assert_equal_grads(results["none"], results[recompute])


def test_users_own_checkpoint_with_recompute_context():
    routes, xs = routes_and_inputs()

    def forward(net, x):
        for block in net.blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=moe.recompute_context)
        return x

    results = {}
    for mode in ("none", "own"):
        net = perturbed(build("none"))
        run = net if mode == "none" else (lambda x, net=net: forward(net, x))
        with moe.replay_routing(net, routes):
            loss = run(xs[0]).square().mean() + run(xs[1]).sin().sum()
            results[mode] = grads(loss, list(net.parameters()))
    assert_equal_grads(results["none"], results["own"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_without_the_context_is_an_error(reentrant):
    routes, xs = routes_and_inputs()
    net = perturbed(build("none"))
    with moe.replay_routing(net, routes):
        x = xs[0].clone().requires_grad_(reentrant)  # reentrant needs an input with grad
        y = checkpoint(net.blocks[0], x, use_reentrant=reentrant)
        with pytest.raises(RuntimeError, match="blocks.0.moe: .*moe.recompute_context"):
            y.sum().backward()


@pytest.mark.parametrize("recompute", ["layer", "blocks", "nested"])
def test_backward_after_leaving_the_replay_block_is_the_librarys_error(recompute):
    """Forward inside replay_routing, backward after the block with recompute on: the
    library's RuntimeError naming the layer, not torch's CheckpointError (issue 41 item 12);
    the same backward inside the block still works."""
    routes, xs = routes_and_inputs()
    net = perturbed(build(recompute))
    with moe.replay_routing(net, routes):
        loss = net(xs[0]).square().mean()
    with pytest.raises(
        RuntimeError, match=r"blocks\.\d\.moe: backward recomputes .* has been left"
    ):
        loss.backward()
    with moe.replay_routing(net, routes):
        net(xs[0]).square().mean().backward()
    assert all(p.grad is not None for p in net.blocks[0].moe.parameters())


def test_recording_under_recompute_records_each_forward_once():
    net = build("blocks")
    xs = routes_and_inputs()[1]
    with moe.record_routing(net) as routes:
        loss = net(xs[0]).sum() + net(xs[1]).sum()
        loss.backward()
    assert [len(records) for records in routes.layers.values()] == [2, 2]
