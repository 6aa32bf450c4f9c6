"""Cost model of the all-to-all: fit, crossover, profiles, and "auto" on 4 gloo ranks."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe.comm import ExchangeConfig
from moe.comm.cost_model import (
    NVLINK_IB,
    CostModel,
    flat_terms,
    hier_terms,
    load_profile,
    save_profile,
)
from moe.comm.expert_exchange import all_to_all, all_to_all_splits
from tests.distributed import run_ranks

TRUE = CostModel(
    a_coll=12e-6, a_intra=2e-6, bw_intra=3e9, a_inter=9e-6, bw_inter=0.4e9, bw_copy=5e9,
    a_ring=6e-6,
)  # fmt: skip
# 4 ranks as 2 nodes x 2: hierarchical saves (a_inter - a_coll) and pays S/4/bw_intra + 2S/bw_copy.
SMALL = CostModel(
    a_coll=1e-6, a_intra=1e-6, bw_intra=1e9, a_inter=5e-6, bw_inter=1e9, bw_copy=8e9, a_ring=1e-6
)


def _synthetic_samples(model: CostModel, noise: float, seed: int):
    """Timings of flat and 1-chunk hierarchical calls on several layouts and sizes."""
    rng = np.random.default_rng(seed)
    samples = []
    for N, L in [(1, 4), (2, 2), (2, 4), (4, 2), (3, 3)]:
        for S in [1 << 10, 37_000, 1 << 20, 5_000_000]:
            rows = [flat_terms(S, N, L, False), flat_terms(S, N, L, True)]
            if N > 1:
                rows += [sum(hier_terms(S, N, L, 1, c)) for c in (False, True)]
            for row in rows:
                t = float(row @ model.vector()) * (1 + noise * rng.standard_normal())
                samples.append((row, t))
    return samples


def test_fit_recovers_known_alpha_beta():
    fitted = CostModel.fit(_synthetic_samples(TRUE, 0.0, 0))
    for f in dataclasses.fields(CostModel):
        got, want = getattr(fitted, f.name), getattr(TRUE, f.name)
        assert got == pytest.approx(want, rel=1e-6), f.name
    noisy = CostModel.fit(_synthetic_samples(TRUE, 0.01, 1))
    assert noisy.bw_inter == pytest.approx(TRUE.bw_inter, rel=0.05)
    assert noisy.a_inter == pytest.approx(TRUE.a_inter, rel=0.1)


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError, match="at least one sample"):
        CostModel.fit([])
    with pytest.raises(ValueError, match="positive and finite"):
        CostModel.fit([(flat_terms(1024, 2, 2), 0.0)])
    with pytest.raises(ValueError, match="7 coefficients"):
        CostModel.fit([(np.ones(3), 1.0)])


@pytest.mark.parametrize("model", [NVLINK_IB, SMALL, TRUE])
@pytest.mark.parametrize("N,L", [(2, 2), (2, 8), (8, 8), (4, 4)])
def test_choose_flips_at_crossover(model, N, L):
    c = model.crossover_bytes(N, L)
    if c == 0:  # never wins: flat at every size, and hierarchical is indeed slower at 0 bytes
        assert model.choose(0, N, L) == "flat"
        assert model.hier_time(0, N, L) > model.flat_time(0, N, L)
        return
    assert model.choose(c, N, L) == "hierarchical"
    assert model.choose(c + 1, N, L) == "flat"
    assert model.hier_time(c, N, L) <= model.flat_time(c, N, L) * (1 + 1e-12)
    assert model.hier_time(c + 2, N, L) > model.flat_time(c + 2, N, L)


def test_nvlink_ib_crossovers():
    """2 x 8: about 5.6 MB (3 network messages saved per rank are not enough at 2 x 4);
    8 x 8: beyond 64 MB per rank."""
    assert NVLINK_IB.crossover_bytes(2, 4) == 0
    assert 5 << 20 < NVLINK_IB.crossover_bytes(2, 8) < 6 << 20
    assert 50 << 20 < NVLINK_IB.crossover_bytes(8, 8) < 64 << 20
    assert NVLINK_IB.crossover_bytes(60, 8) > 64 << 20
    assert NVLINK_IB.choose(1 << 30, 1, 8) == "flat"


def test_profile_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "p.json"
    save_profile(TRUE, path, meta={"machine": "test"})
    assert load_profile(path) == TRUE
    doc = json.loads(path.read_text())
    doc["model"]["bw_inter"] = -1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="bw_inter"):
        load_profile(path)
    del doc["model"]["bw_inter"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="'model' must have exactly"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(path)
    with pytest.raises(ValueError, match="not a file"):
        load_profile(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("a_inter", 1e308, "CostModel.a_inter=1e+308 s is outside the physical range"),
        ("a_coll", 2.0, "CostModel.a_coll=2.0 s is outside the physical range"),
        ("a_ring", -1e-6, "CostModel.a_ring=-1e-06 s is outside"),
        ("bw_inter", 1e-320, "CostModel.bw_inter=1e-320 B/s is outside the physical range"),
        ("bw_copy", 1e15, "CostModel.bw_copy=1000000000000000.0 B/s is outside"),
        ("bw_intra", 0.0, "CostModel.bw_intra=0.0 B/s is outside"),
        ("a_intra", float("nan"), "CostModel.a_intra must be a finite number"),
        ("bw_intra", "1e9", "CostModel.bw_intra must be a finite number"),
        ("a_coll", True, "CostModel.a_coll must be a finite number"),
    ],
)
def test_values_outside_physical_ranges_are_refused(tmp_path, field, value, message):
    """Built or loaded: a hostile profile is a ValueError naming the field, not a NaN in the
    crossover and 'cannot convert float NaN to integer' in every rank's first all-to-all."""
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(NVLINK_IB, **{field: value})
    path = tmp_path / "hostile.json"
    doc = {"version": 1, "model": {**dataclasses.asdict(NVLINK_IB), field: value}, "meta": {}}
    path.write_text(json.dumps(doc))
    if value != value:  # NaN is no JSON number: the reader refuses it, naming where it is
        message = f"model.{field} is NaN, not a finite number"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_profile(path)


def test_extreme_but_valid_models_choose_without_error():
    """At the ends of the ranges the crossover stays a finite int."""
    slowest = CostModel(1.0, 1.0, 1e3, 1.0, 1e3, 1e3, 1.0)
    fastest = CostModel(0.0, 0.0, 1e14, 0.0, 1e14, 1e14, 0.0)
    mixed = CostModel(0.0, 0.0, 1e14, 1.0, 1e3, 1e14, 0.0)
    for model in (slowest, fastest, mixed):
        for N, L in [(2, 2), (64, 8)]:
            assert model.choose(1 << 20, N, L) in ("flat", "hierarchical")
            assert 0 <= model.crossover_bytes(N, L) <= 1 << 62
    unexercised = CostModel.fit([(flat_terms(1 << 20, 1, 4), 1e-3)])  # no network samples
    assert unexercised.bw_inter == 1e14 and unexercised.a_inter == 0.0


def _auto_body(rank: int, world_size: int) -> list[str]:
    """Uneven splits whose largest per-rank buffer sits just at / just past the crossover."""
    problems = []
    D, elem = 4, 4
    crossover = SMALL.crossover_bytes(2, 2)
    small = ExchangeConfig(cost_model=SMALL)
    for big_rows, want in [
        (crossover // (D * elem), "hierarchical"),
        (crossover // (D * elem) + 1, "flat"),
    ]:
        g = torch.Generator().manual_seed(big_rows)
        totals = torch.randint(0, big_rows, (world_size,), generator=g)
        totals[big_rows % world_size] = big_rows
        cuts = [torch.randint(0, int(t) + 1, (world_size - 1,), generator=g) for t in totals]
        C = torch.stack(
            [
                torch.diff(torch.cat([torch.tensor([0]), c.sort().values, t.view(1)]))
                for c, t in zip(cuts, totals)
            ]
        )
        xs = [torch.randn(int(C[s].sum()), D, generator=g) for s in range(world_size)]
        plan = all_to_all_splits(
            xs[rank], C[rank], algorithm="auto", ranks_per_node=2, exchange_config=small
        )
        flags = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
        mine = torch.tensor([int(plan.algorithm == "hierarchical")])
        dist.all_gather(flags, mine)
        if plan.algorithm != want:
            problems.append(f"rows {big_rows}: auto chose {plan.algorithm}, want {want}")
        if len({int(f) for f in flags}) != 1:
            problems.append(f"rows {big_rows}: ranks disagree {[int(f) for f in flags]}")
        y, _ = all_to_all(
            xs[rank], C[rank], algorithm="auto", ranks_per_node=2, exchange_config=small
        )
        ref = torch.cat([torch.split(xs[s], C[s].tolist())[rank] for s in range(world_size)])
        if not torch.equal(y, ref):
            problems.append(f"rows {big_rows}: {want} exchange differs from the reference")
    return problems


def test_auto_same_choice_on_every_rank_and_flips_at_model_size():
    results = run_ranks(_auto_body, 4, timeout=60)
    problems = [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs]
    assert not problems, "\n".join(problems)


def _stats_body(rank: int, world_size: int) -> dict[str, int]:
    """One forward of an EP=4 layer per setting; layer.stats shows what "auto" chose."""
    import moe
    from moe.parallel import init_mesh, parallelize

    seen = {}
    for name, model in [("gloo default", None), ("small model", SMALL)]:
        torch.manual_seed(0)
        layer = moe.MoELayer(8, 16, 4, top_k=2)
        exchange = ExchangeConfig(cost_model=model)
        layer = parallelize(layer, init_mesh(dp=1, ep=4), algorithm="auto", ranks_per_node=2,
                            exchange=exchange)  # fmt: skip
        layer(torch.randn(3 + rank, 8))
        seen[name] = int(layer.stats["a2a_hierarchical"])
    return seen


def test_layer_stats_show_the_chosen_algorithm():
    results = run_ranks(_stats_body, 4, timeout=60)
    assert results == [{"gloo default": 0, "small model": 1}] * 4


def _exchange_config_body(rank: int, world_size: int) -> dict[str, int]:
    """parallelize(exchange=ExchangeConfig(...)): the dispatcher holds it and "auto" follows
    its threshold and ranks per node (no env variable)."""
    import moe
    from moe.comm import ExchangeConfig
    from moe.parallel import init_mesh, parallelize

    seen = {}
    configs = {
        "default": None,
        "2 nodes, 1 GiB threshold": ExchangeConfig(
            ranks_per_node=2, hierarchical_max_bytes=1 << 30
        ),
        "2 nodes, threshold 0": ExchangeConfig(ranks_per_node=2, hierarchical_max_bytes=0),
    }
    for name, config in configs.items():
        torch.manual_seed(0)
        layer = moe.MoELayer(8, 16, 4, top_k=2)
        layer = parallelize(layer, init_mesh(dp=1, ep=4), algorithm="auto", exchange=config)
        assert layer.dispatcher.exchange_config == (config or ExchangeConfig())
        layer(torch.randn(3 + rank, 8))
        seen[name] = int(layer.stats["a2a_hierarchical"])
    return seen


def test_exchange_config_decides_auto():
    results = run_ranks(_exchange_config_body, 4, timeout=60)
    want = {"default": 0, "2 nodes, 1 GiB threshold": 1, "2 nodes, threshold 0": 0}
    assert results == [want] * 4


def test_a_too_long_profile_path_given_in_code_is_one_clear_error():
    """Given in code (not the environment), a path the file system cannot take is a ValueError
    naming the cost profile, not a raw OSError (issue 49, item 13)."""
    from moe.comm import ExchangeConfig

    with pytest.raises(ValueError, match="cost profile=.*is not a path: longer than"):
        ExchangeConfig(cost_profile="/tmp/" + "p" * 5000).profile()
