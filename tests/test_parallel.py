"""EP x DP on gloo ranks equals single-process training on the global batch."""

import dataclasses
import json
import os
from dataclasses import replace

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
    SGD where gradients are communicated in bf16 (Adam would amplify rounding of tiny grads)
    and in float64 (SGD's step is proportional to the gradient: a wrong scale shows)."""
    dtype = next(model.parameters()).dtype
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        n_global = x.shape[0]
        x, y = x[shard].to(dtype), y[shard].to(dtype)
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
        model = build_model(**options.get("model", {})).to(options.get("dtype", torch.float32))
        model = parallelize(model, mesh, **options.get("parallel", {}))
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
    # float64 used to take FSDP2's other divide branch: expert gradients 1/world too small
    ("dp1_ep4_float64_ddp", 1, 4, [3, 5, 0, 4], {"dtype": torch.float64, "sgd": True}),
]
TOLERANCES = {
    "bf16": {"rtol": 2e-2, "atol": 2e-3},
    "float64": {"rtol": 1e-10, "atol": 1e-12},
    "": {"rtol": 1e-4, "atol": 1e-5},
}


@pytest.mark.parametrize("dispatcher", ["expert_parallel", "allgather"])
def test_ep_dp_training_equals_single_process(dispatcher):
    results = run_ranks(_ep_dp_body, 4, CASES, dispatcher, timeout=120)
    for name, _dp, ep, sizes, options in CASES:
        reference = build_model().to(options.get("dtype", torch.float32))
        train(reference, global_batches(sizes), slice(None), 1, "sgd" in options)
        ref_params = dict(reference.named_parameters())
        tol = next(t for key, t in TOLERANCES.items() if key in name)
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


def _settings_error(rank, model, mesh, env, cost_model, **kwargs):
    """parallelize's error message on this rank, with `env` set and `cost_model` given in its
    ExchangeConfig."""
    from moe.comm import ExchangeConfig

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        if cost_model is not None:
            kwargs["exchange"] = ExchangeConfig(cost_model=cost_model)
        parallelize(model, mesh, **kwargs)
    except ValueError as e:
        return str(e)
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return "no error"


def _mismatch_body(rank, world, profile_dir):
    """Rank 3 differs in one setting at a time (or fails locally); every rank must name it,
    and none may hang."""
    from moe.comm import ExchangeConfig
    from moe.comm.cost_model import NVLINK_IB

    odd = rank == 3
    hostile = os.path.join(profile_dir, "hostile.json")
    if rank == 0:
        doc = {"version": 1, "model": {**dataclasses.asdict(NVLINK_IB), "a_inter": 1e308}}
        with open(hostile, "w") as f:
            json.dump(doc, f)
    dist.barrier()
    hier = {"algorithm": "hierarchical", "ranks_per_node": 2}
    cases = {  # name: (env, cost model, parallelize kwargs); dp=1, ep=4
        "algorithm": ({}, None, {"algorithm": "flat" if odd else "hierarchical"}),
        "ranks_per_node": ({}, None, {**hier, "ranks_per_node": 4 if odd else 2}),
        "env": ({"MOE_RANKS_PER_NODE": "4" if odd else "2"}, None, {"algorithm": "auto"}),
        "local_world_size": ({"LOCAL_WORLD_SIZE": "2" if odd else "4"}, None, {}),
        "data_parallel": ({}, None, {"data_parallel": "fsdp" if odd else "ddp"}),
        "reduce_dtype": ({}, None, {"grad_dtype": torch.bfloat16 if odd else None}),
        "cost_model": ({}, replace(NVLINK_IB, a_inter=5e-6) if odd else NVLINK_IB, {}),
        "bad_setting": ({}, None, {"data_parallel": "zero" if odd else "ddp"}),
        "hostile_profile": ({"MOE_A2A_COST_PROFILE": hostile} if odd else {}, None, {}),
        "exchange": ({}, None, {"exchange": ExchangeConfig(pipeline_min_bytes=1 if odd else 2)}),
    }
    out = {"num_experts": _settings_error(rank, build_model(num_experts=8 if odd else 4),
                                          init_mesh(dp=2, ep=2), {}, None)}  # fmt: skip
    for name, (env, cost_model, kwargs) in cases.items():
        out[name] = _settings_error(rank, build_model(), init_mesh(dp=1, ep=4), env, cost_model,
                                    **kwargs)  # fmt: skip
    dist.barrier()  # still in step after every failed check
    return out


def test_mismatched_config_raises_on_every_rank(tmp_path):
    """Models or settings that differ across ranks (which used to hang in the first
    all-to-all or FSDP collective) are one error on every rank, naming the field and ranks."""
    expected = {
        "num_experts": ["1.num_experts differs across ranks", "rank 3 has 8"],
        "algorithm": ["algorithm differs across ranks", "rank 3 has flat"],
        "ranks_per_node": ["ranks_per_node differs across ranks", "rank 3 has 4"],
        "env": ["ranks_per_node differs across ranks", "rank 3 has 4", "ranks 0-2 have 2"],
        "local_world_size": ["ranks_per_node differs across ranks", "rank 3 has 2"],
        "data_parallel": ["data_parallel differs across ranks", "rank 3 has fsdp"],
        "reduce_dtype": ["mp_policy.reduce_dtype differs", "rank 3 has torch.bfloat16"],
        "cost_model": ["cost_model.a_inter differs across ranks", "rank 3 has 5e-06"],
        "bad_setting": ["setup failed on 1 rank(s): rank 3", "data_parallel must be"],
        "hostile_profile": ["rank 3: ValueError: CostModel.a_inter=1e+308 s is outside"],
        "exchange": ["exchange.pipeline_min_bytes differs across ranks", "rank 3 has 1"],
    }
    results = run_ranks(_mismatch_body, 4, str(tmp_path), timeout=60)
    for rank, out in enumerate(results):
        for name, fragments in expected.items():
            for fragment in fragments:
                assert fragment in out[name], (rank, name, out[name])


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
