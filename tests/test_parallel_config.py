"""ParallelConfig: one typed home for parallelize's settings; ranks per node resolved once;
the deprecated process-wide exchange setters; dispatcher capabilities; parallelize acting on
the ranks of its mesh only (sub-meshes of a pipeline layout)."""

import dataclasses
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import moe
from moe.comm import NVLINK_IB, ExchangeConfig
from moe.comm.alltoall import cost_model, hierarchical_threshold
from moe.dispatch import Dispatcher, ExpertParallelDispatcher, OverlappedDispatcher
from moe.parallel import ParallelConfig, init_mesh, parallelize
from tests import allgather_dispatcher
from tests.distributed import run_ranks

D, F = 8, 12


@pytest.mark.parametrize(
    "field, value",
    [
        ("data_parallel", "zero"),
        ("algorithm", "ring"),
        ("ranks_per_node", 0),
        ("ranks_per_node", True),
        ("mp_policy", "bf16"),
        ("offload_policy", "cpu"),
        ("reshard_after_forward", 0),
        ("grad_dtype", "bfloat16"),
        ("sync_params", 1),
        ("overlap", 0),
        ("exchange", {"ranks_per_node": 2}),
        ("dispatcher", "nope"),
    ],
)
def test_every_field_is_checked_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"ParallelConfig\.{field}"):
        ParallelConfig(**{field: value})


def test_combinations_are_checked():
    with pytest.raises(ValueError, match="give grad_dtype or mp_policy, not both"):
        ParallelConfig(grad_dtype=torch.bfloat16, mp_policy=MixedPrecisionPolicy())
    with pytest.raises(ValueError, match="dispatcher='allgather' takes no overlap degree"):
        ParallelConfig(dispatcher="allgather", overlap=2)
    assert ParallelConfig(overlap="auto").dispatcher_name == "overlap"
    assert ParallelConfig().dispatcher_name == "expert_parallel"


def test_a_new_field_is_recorded_with_no_other_change():
    """Pipeline stages add a field (e.g. pp): the agreement record carries it as it is."""

    @dataclasses.dataclass(frozen=True)
    class WithStages(ParallelConfig):
        pp: int = 1

    record = WithStages(pp=2, overlap=2).record()
    assert record["pp"] == 2 and record["overlap"] == "2" and record["dispatcher"] == "overlap"
    assert record["mp_policy.reduce_dtype"] == "None"


def test_dispatchers_declare_their_capabilities():
    assert (Dispatcher.overlaps, Dispatcher.takes_wire) == (False, False)
    assert (ExpertParallelDispatcher.overlaps, ExpertParallelDispatcher.takes_wire) == (False, True)
    assert (OverlappedDispatcher.overlaps, OverlappedDispatcher.takes_wire) == (True, True)
    cls = allgather_dispatcher.AllGatherDispatcher
    assert (cls.overlaps, cls.takes_wire) == (False, False)
    from moe.parallel import config_check
    from moe.parallel import parallelize as parallelize_module

    for module in (config_check, parallelize_module):  # declared, not probed
        assert "inspect.signature" not in inspect.getsource(module)


def test_deprecated_setters_warn_still_work_and_a_field_given_wins(monkeypatch):
    from moe.comm import set_cost_model, set_hierarchical_threshold

    monkeypatch.setenv("MOE_A2A_HIERARCHICAL_MAX_BYTES", "9")
    mine = dataclasses.replace(NVLINK_IB, a_inter=5e-6)
    try:
        with pytest.warns(DeprecationWarning, match="ExchangeConfig\\(hierarchical_max_bytes="):
            set_hierarchical_threshold(5)
        with pytest.warns(DeprecationWarning, match="ExchangeConfig\\(cost_model="):
            set_cost_model(NVLINK_IB)
        by_setter = ExchangeConfig()  # setter > environment
        assert by_setter.hierarchical_max_bytes == 5
        assert by_setter.source("hierarchical_max_bytes") == "setter"
        assert hierarchical_threshold(None, "gloo", by_setter) == 5
        assert cost_model("gloo", by_setter) is NVLINK_IB
        given = ExchangeConfig(hierarchical_max_bytes=7, cost_model=mine)  # code > setter
        assert hierarchical_threshold(None, "gloo", given) == 7
        assert cost_model("gloo", given) is mine
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            set_hierarchical_threshold(None)
            set_cost_model(None)
    assert ExchangeConfig().hierarchical_max_bytes == 9  # unset: the environment again
    assert cost_model("gloo", ExchangeConfig()) is None
    assert cost_model("gloo", ExchangeConfig(cost_model=mine)) is mine
    with pytest.raises(ValueError, match="ExchangeConfig.cost_model must be a CostModel"):
        ExchangeConfig(cost_model="fast")
    with pytest.raises(ValueError, match="cost_model or ExchangeConfig.cost_profile, not both"):
        ExchangeConfig(cost_model=mine, cost_profile="links.json")


def _one_value_body(rank, world):
    """ExchangeConfig(ranks_per_node=1) on 2 ranks: the exchange and the replica split must
    read one value (they read 1 and 2 before ParallelConfig)."""
    import moe.comm.expert_exchange as expert_exchange
    import moe.dispatch.expert_parallel as split_module

    seen = {"exchange": set(), "split": set()}
    get_topology, copy_candidates = expert_exchange.get_topology, split_module.copy_candidates

    def topology_spy(*args, **kwargs):
        topo = get_topology(*args, **kwargs)
        seen["exchange"].add(topo.ranks_per_node)
        return topo

    def split_spy(*args):
        seen["split"].add(args[-1])  # ranks_per_node
        return copy_candidates(*args)

    expert_exchange.get_topology, split_module.copy_candidates = topology_spy, split_spy
    out = {}
    for name in ("keywords", "config"):
        torch.manual_seed(0)
        layer = moe.MoELayer(D, F, 6, top_k=2, spare_slots=2)
        exchange = ExchangeConfig(ranks_per_node=1)
        if name == "keywords":
            layer = parallelize(layer, init_mesh(dp=1, ep=2), algorithm="hierarchical",
                                exchange=exchange)  # fmt: skip
        else:
            config = ParallelConfig(algorithm="hierarchical", exchange=exchange)
            layer = parallelize(layer, init_mesh(dp=1, ep=2), config=config)
        y = layer(torch.randn(5 + rank, D, generator=torch.Generator().manual_seed(rank)))
        out[name] = (y.detach(), layer.dispatcher.ranks_per_node)
    out["seen"] = {k: sorted(v) for k, v in seen.items()}
    try:  # both forms at once: one error on every rank, before any exchange
        parallelize(moe.MoELayer(D, F, 6, top_k=2), init_mesh(dp=1, ep=2),
                    config=ParallelConfig(), algorithm="flat")  # fmt: skip
        out["both"] = "no error"
    except ValueError as e:
        out["both"] = str(e)
    return out


def test_exchange_and_replica_split_read_one_ranks_per_node():
    results = run_ranks(_one_value_body, 2, timeout=90)
    for out in results:
        assert out["seen"] == {"exchange": [1], "split": [1]}, out["seen"]
        assert out["keywords"][1] == out["config"][1] == 1
        assert torch.equal(out["keywords"][0], out["config"][0])  # config= is the keywords
        assert "setup failed on 2 rank(s)" in out["both"]
        assert "give config= or keywords, not both" in out["both"]


def _stage_model(seed, moe_layers):
    """Linear, then `moe_layers` x (MoELayer, Linear), float64."""
    torch.manual_seed(seed)
    blocks = [nn.Linear(D, D)]
    for _ in range(moe_layers):
        blocks += [moe.MoELayer(D, F, 4, top_k=2, aux_loss_coef=0.0), nn.Linear(D, D)]
    return nn.Sequential(*blocks).to(torch.float64)


def _grads(model, x, y, n_global, factor=1):
    loss = (model(x) - y).square().sum() * factor / (n_global * D)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _sub_mesh_body(rank, world):
    """(pp, dp, ep) = (2, 1, 2): each half of the ranks parallelizes its own model on its
    own mesh["dp", "ep"]; float64 gradients must equal one process running that model."""
    stage, inner = divmod(rank, 2)
    out = {}
    cases = {  # name: (seed, MoE layers) per stage
        "same shapes, other weights": [(10, 1), (20, 1)],
        "other layer counts": [(30, 2), (40, 1)],
    }
    for name, per_stage in cases.items():
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "ep"))["dp", "ep"]
        seed, layers = per_stage[stage]
        model, reference = _stage_model(seed, layers), _stage_model(seed, layers)
        if inner == 1:  # sync_params must bring the mesh's first rank's weights here
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        model = parallelize(model, mesh, grad_dtype=torch.float64)
        g = torch.Generator().manual_seed(100 + stage)
        x, y = torch.randn(9, D, generator=g), torch.randn(9, D, generator=g)
        x, y = x.to(torch.float64), y.to(torch.float64)
        rows = slice(0, 4) if inner == 0 else slice(4, 9)
        got = _grads(model, x[rows], y[rows], 9, factor=2)
        want = _grads(reference, x, y, 9)
        errors = {n: (got[n].full_tensor() - want[n]).abs().max().item() for n in want}
        groups = {
            tuple(dist.get_process_group_ranks(layer.router.load_group))
            for _, layer in moe.moe_layers(model)
        }
        out[name] = (max(errors.values()), sorted(groups))
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "ep"))["dp", "ep"]
    top_k = 1 if rank == 3 else 2  # only the second half disagrees
    torch.manual_seed(0)
    model = nn.Sequential(moe.MoELayer(D, F, 4, top_k=top_k))
    try:
        parallelize(model, mesh)
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    dist.barrier()  # every rank still in step
    return out


def test_parallelize_acts_on_the_ranks_of_its_mesh_only():
    results = run_ranks(_sub_mesh_body, 4, timeout=120)
    for rank, out in enumerate(results):
        stage = rank // 2
        for name in ("same shapes, other weights", "other layer counts"):
            error, groups = out[name]
            assert error < 1e-12, (rank, name, error)
            assert groups == [(2 * stage, 2 * stage + 1)], (rank, name, groups)
    assert results[0]["mismatch"] == results[1]["mismatch"] == "no error"
    for rank in (2, 3):
        message = results[rank]["mismatch"]
        assert "of global ranks [2, 3]" in message, message
        assert "0.top_k differs across ranks: rank 0 has 2, rank 1 has 1" in message, message
