"""EP x DP on gloo ranks equals single-process training on the global batch."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe
from moe.dispatch import build_dispatcher
from moe.parallel import init_mesh, parallelize
from tests import allgather_dispatcher  # noqa: F401  (registers "allgather")
from tests.distributed import run_ranks

D, F, E, STEPS = 12, 20, 4, 3


def build_model(seed=0, num_experts=E, **options):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D, D),
        moe.MoELayer(D, F, num_experts, top_k=2, aux_loss_coef=0.0, **options),
        nn.Linear(D, D),
        moe.MoELayer(D, F, num_experts, top_k=1, aux_loss_coef=0.0, **options),
    )


def global_batches(sizes):
    """STEPS batches; rank r's shard is rows [sum(sizes[:r]), sum(sizes[:r+1]))."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(sum(sizes), D, generator=g), torch.randn(sum(sizes), D, generator=g))
        for _ in range(STEPS)
    ]


def train(model, batches, shard, world, sgd=False):
    """Optimizer steps; the loss is normalised so its sum over ranks / world is the global mean.
    SGD where gradients are communicated in bf16: Adam would amplify rounding of tiny grads."""
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        n_global = x.shape[0]
        x, y = x[shard], y[shard]
        loss = (model(x) - y).square().sum() * world / (n_global * D)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _shard(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _ep_dp_body(rank, world, cases, dispatcher):
    out = {}
    for name, dp, ep, sizes, options in cases:
        mesh = init_mesh(dp=dp, ep=ep)
        model = parallelize(
            build_model(**options.get("model", {})), mesh, **options.get("parallel", {})
        )
        if dispatcher != "expert_parallel":  # another strategy behind the same seam
            for _, layer in moe.moe_layers(model):
                layer.dispatcher = build_dispatcher(
                    dispatcher, group=mesh.get_group("ep"), num_local_experts=E // ep
                )
        losses = train(model, global_batches(sizes), _shard(sizes, rank), world, "sgd" in options)
        out[name] = (
            {n: p.detach().full_tensor() for n, p in model.named_parameters()},
            losses,
            [layer.experts.expert_offset for _, layer in moe.moe_layers(model)],
        )
    return out


CASES = [
    ("dp2_ep2_flat", 2, 2, [5, 7, 3, 6], {"parallel": {"algorithm": "flat"}}),
    (
        "dp1_ep4_hier_zero_tokens",
        1,
        4,
        [6, 0, 9, 4],
        {"parallel": {"algorithm": "hierarchical", "ranks_per_node": 2}},
    ),
    (
        "dp2_ep2_bf16_comm",
        2,
        2,
        [4, 4, 4, 4],
        {"parallel": {"grad_dtype": torch.bfloat16}, "sgd": True},
    ),
]


@pytest.mark.parametrize("dispatcher", ["expert_parallel", "allgather"])
def test_ep_dp_training_equals_single_process(dispatcher):
    results = run_ranks(_ep_dp_body, 4, CASES, dispatcher, timeout=120)
    for name, _dp, ep, sizes, options in CASES:
        reference = build_model()
        train(reference, global_batches(sizes), slice(None), 1, "sgd" in options)
        ref_params = dict(reference.named_parameters())
        tol = {"rtol": 2e-2, "atol": 2e-3} if "bf16" in name else {"rtol": 1e-4, "atol": 1e-5}
        for rank in range(4):
            params, _, offsets = results[rank][name]
            assert offsets[0] == (rank % ep) * (E // ep)
            for pname, p in params.items():  # global DTensors gathered: the whole model
                expected = ref_params[pname].detach()
                torch.testing.assert_close(p, expected, **tol, msg=f"{name} rank {rank} {pname}")


def _frozen_body(rank, world):
    model = build_model()
    model[0].weight.requires_grad_(False)  # a frozen dense parameter
    model[1].experts.w2.requires_grad_(False)  # and a frozen expert parameter
    model = parallelize(model, init_mesh(dp=2, ep=2))
    (model(torch.randn(3 + rank, D)).square().mean()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    frozen = grads["0.weight"] is None and grads["1.experts.w2"] is None
    return frozen, grads["0.bias"].full_tensor()


def test_frozen_parameters_are_left_alone():
    results = run_ranks(_frozen_body, 4, timeout=60)
    assert all(frozen_untouched for frozen_untouched, _ in results)
    for _, bias_grad in results[1:]:  # reduced: identical on every rank
        assert torch.equal(bias_grad, results[0][1])


def _mismatch_body(rank, world):
    model = build_model(num_experts=8 if rank == 3 else 4)
    try:
        parallelize(model, init_mesh(dp=2, ep=2))
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_config_raises_on_every_rank():
    messages = run_ranks(_mismatch_body, 4, timeout=60)
    for m in messages:
        assert "num_experts differs across ranks" in m and "rank 3 has 8" in m


def _bad_ep_body(rank, world):
    errors = []
    for kwargs in ({"dp": 1, "ep": 3}, {"dp": 3, "ep": 2}):
        try:
            init_mesh(**kwargs)
        except ValueError as e:
            errors.append(str(e))
    model = nn.Sequential(moe.MoELayer(D, F, 6, top_k=2))
    try:
        parallelize(model, init_mesh(dp=1, ep=4))
    except ValueError as e:
        errors.append(str(e))
    dist.barrier()
    return errors


def test_bad_mesh_and_indivisible_experts_are_clear_errors():
    errors = run_ranks(_bad_ep_body, 4, timeout=60)[0]
    assert "ep=3 must be a positive divisor of the world size 4" in errors[0]
    assert "dp=3 x ep=2 = 6 does not equal the world size 4" in errors[1]
    assert "num_experts=6 is not divisible by ep=4" in errors[2]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
