"""Expert replicas (MoEConfig.spare_slots): the planner, the dispatch split and exact training.

A model with spare slots holding copies of experts computes what the same model without
replicas computes: outputs and every gradient (the copies' gradients summed by
moe.parallel.sum_replica_grads), then the optimizer steps, in float64 to 1e-12, in one process
and on 2 and 4 gloo ranks (ddp and fsdp, plain and overlapped dispatcher, flat and
hierarchical exchange), with capacity drops, a rank with zero tokens and experts that receive
nothing; rebalance_experts then copies the hot experts (moving only the slots that change,
with their AdamW state) and training stays equal to the run without replicas."""

import random

import pytest
import torch
from torch.distributed.tensor import DTensor

import moe
from moe.checkpoint import load_checkpoint, save_checkpoint
from moe.dispatch.replica_split import copy_candidates
from moe.parallel import init_mesh, parallelize
from moe.parallel.rebalance import rebalance_experts
from moe.parallel.replicas import sum_replica_grads
from moe.slots.layout import initial_expert_of_slot
from moe.slots.replica_placement import (
    check_replica_placement,
    choose_copies,
    choose_replicas,
    rank_loads,
)
from tests.distributed import run_ranks

D, F, E = 12, 20, 8
TOL64 = {"rtol": 1e-12, "atol": 1e-12}


# -- planner -------------------------------------------------------------------------------


def test_planner_copies_hot_experts_on_different_ranks_and_meets_the_bound():
    rng = random.Random(0)
    for E_, W, R in [(8, 2, 2), (8, 4, 4), (12, 4, 8), (16, 8, 8), (64, 8, 8), (6, 3, 3)]:
        for _ in range(20):
            load = [rng.paretovariate(1.1) for _ in range(E_)]
            p = choose_replicas(load, initial_expert_of_slot(E_, R), W, min_gain=0.0)
            check_replica_placement(p.expert_of_slot, E_, W)  # copies on different ranks
            assert len(p.expert_of_slot) == E_ + R
            assert abs(max(rank_loads(load, p.expert_of_slot, W)) - p.max_after) < 1e-9
            lower = max(p.mean, p.bound)
            assert p.max_after >= lower - 1e-9
            hottest = max(range(E_), key=load.__getitem__)
            assert p.copies[hottest] == max(p.copies)
    # one spare slot per rank takes a Zipf load (s = 1.2) to within 5% of the mean
    from bench.rebalance import zipf_load

    for E_ in (64, 128):
        load = zipf_load(E_, 1.2)
        p = choose_replicas(load, initial_expert_of_slot(E_, 8), 8, min_gain=0.0)
        assert p.max_after / p.mean <= 1.05, p.max_after / p.mean


def test_planner_keeps_small_gains_and_moves_only_changed_slots():
    load = [10.0, 1, 1, 1, 1, 1, 1, 1]
    p = choose_replicas(load, initial_expert_of_slot(8, 2), 2, min_gain=0.0)
    again = choose_replicas(load, p.expert_of_slot, 2, min_gain=0.05)
    assert not again.changed and again.expert_of_slot == p.expert_of_slot
    assert set(p.moved_slots) == {
        s for s in range(10) if p.expert_of_slot[s] != initial_expert_of_slot(8, 2)[s]
    }
    with pytest.raises(ValueError, match="more copies than there are ranks"):
        choose_copies([1.0, 2.0], 6, 2)
    with pytest.raises(ValueError, match="two copies of one expert"):
        choose_replicas(load, [0, 1, 2, 3, 0, 0, 4, 5, 6, 7], 2)


def test_copy_candidates_prefer_the_sending_rank_then_its_node():
    eos = torch.tensor([0, 1, 2, 3, 0, 4, 5, 0])  # 8 slots on 4 ranks of 2 (2 nodes of 2)
    order, first, count = copy_candidates(eos, 6, rank=2, slots_per_rank=2, ranks_per_node=2)
    assert order[first[0] : first[0] + count[0]].tolist() == [4]  # its own copy
    order, first, count = copy_candidates(eos, 6, rank=1, slots_per_rank=2, ranks_per_node=2)
    assert order[first[0] : first[0] + count[0]].tolist() == [0]  # rank 0, same node
    order, first, count = copy_candidates(eos, 6, rank=1, slots_per_rank=2, ranks_per_node=4)
    assert order[first[0] : first[0] + count[0]].tolist() == [0, 4, 7]  # one node: all


# -- exactness -----------------------------------------------------------------------------


def _pair(R, seed=0, dtype=torch.float64, **options):
    """The same model without and with R spare slots (copies of its experts' weights)."""
    torch.manual_seed(seed)

    def build(spare):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(D, D),
            moe.MoELayer(D, F, E, top_k=2, capacity_factor=1.0, spare_slots=spare, **options),
            torch.nn.Linear(D, D),
            moe.MoELayer(D, F, E, top_k=1, activation="swiglu", spare_slots=spare, **options),
        ).to(dtype)

    ref, rep = build(0), build(R)
    with torch.no_grad():
        for layer in (ref[1], ref[3]):  # hot experts 0 and 1
            layer.router.weight[:2] *= 4.0
        rep.load_state_dict(
            {k: v for k, v in ref.state_dict().items() if ".experts." not in k and "slot" not in k},
            strict=False,
        )
        for a, b in ((ref[1], rep[1]), (ref[3], rep[3])):
            for pa, pb in zip(a.experts.parameters(), b.experts.parameters()):
                pb.copy_(pa[b.expert_of_slot_S] if R else pa)
    return ref, rep


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _canonical(model, grads=False):
    """Every parameter (or gradient) with expert rows in canonical order; copies checked equal."""
    out = {}
    for name, p in model.named_parameters():
        full = _full(p.grad if grads else p)
        if ".experts." in name:
            layer = model.get_submodule(name.rsplit(".experts.", 1)[0])
            if layer.config.spare_slots:
                first = full[layer.slot_of_expert_E]
                copies = first[layer.expert_of_slot_S]
                torch.testing.assert_close(full, copies, rtol=0, atol=0, msg=f"copies of {name}")
            full = full[layer.slot_of_expert_E]
        out[name] = full
    return out


@pytest.mark.parametrize(
    "T, dtype, options",
    [
        (29, torch.float64, {}),
        (1, torch.float64, {}),
        (29, torch.float64, {"recompute": True, "drop_policy": "probs"}),
        (29, torch.float32, {}),
    ],
)
def test_single_process_replicas_are_exact(T, dtype, options):
    """T = 29: capacity drops; T = 1: every expert but one or two receives nothing; activation
    recompute; float32 to 1e-6 relative."""
    ref, rep = _pair(3, dtype=dtype, **options)
    tol = TOL64 if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    x = torch.randn(T, D, dtype=dtype)
    for model in (ref, rep):
        (model(x).square().sum() + moe.aux_loss(model)).backward()
    sum_replica_grads(rep)
    torch.testing.assert_close(rep(x), ref(x), **tol)
    for key in ("tokens_per_expert", "routed_per_expert", "dropped"):
        assert torch.equal(rep[1].stats[key], ref[1].stats[key]), key
    assert int(ref[1].stats["dropped"]) > 0 if T > 1 else int(ref[1].stats["dead_experts"]) > 0
    ga, gb = _canonical(ref, grads=True), _canonical(rep, grads=True)
    for name, g in ga.items():
        torch.testing.assert_close(gb[name], g, **tol, msg=name)
    norm = moe.parallel.clip_grad_norm_(ref, 0.1)  # each expert counted once
    torch.testing.assert_close(moe.parallel.clip_grad_norm_(rep, 0.1), norm, **tol)


def _batch(step, n=24):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, D, generator=g, dtype=torch.float64), torch.randn(
        n, D, generator=g, dtype=torch.float64
    )


def _rows(rank, world, step, n):
    """Rank 1 has no tokens at step 1; the others split the batch."""
    if step == 1 and world > 1:
        owners = [r for r in range(world) if r != 1]
    else:
        owners = list(range(world))
    if rank not in owners:
        return slice(0, 0)
    per = n // len(owners)
    i = owners.index(rank)
    return slice(i * per, n if i == len(owners) - 1 else (i + 1) * per)


def _step(model, opt, step, rank, world, replicas, micro=1, mesh=None):
    x, y = _batch(step)
    rows = _rows(rank, world, step, x.shape[0])
    x, y = x[rows], y[rows]
    for xs, ys in zip(x.tensor_split(micro), y.tensor_split(micro)):  # gradient accumulation
        loss = (model(xs) - ys).square().sum() * world / (_batch(step)[0].shape[0] * D)
        loss.backward()
    if replicas:
        sum_replica_grads(model)
    moe.parallel.clip_grad_norm_(model, 0.5, mesh)  # active: the norm is larger
    grads = _canonical(model, grads=True)
    opt.step()
    opt.zero_grad()
    return grads


def _run_body(rank, world, layouts, path=None):
    out = {}
    probe = _batch(99)[0]
    for layout in layouts:
        dp, ep, mode, extra = layout
        extra = dict(extra)
        grouped, micro = extra.pop("grouped", False), extra.pop("micro", 1)
        mesh = init_mesh(dp=dp, ep=ep)
        ref, rep = _pair(world)
        runs = {}
        for replicas, model in ((False, ref), (True, rep)):
            model = parallelize(model, mesh, mode, **extra)
            if grouped:  # state read through state_of, stepped in 2 groups
                opt = moe.memory.GroupedApply(
                    model.parameters(), torch.optim.AdamW, groups=2, lr=1e-2, weight_decay=0.1
                )
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            grads = [_step(model, opt, s, rank, world, replicas, micro, mesh) for s in (0, 1)]
            report = None
            if replicas:
                with torch.no_grad():
                    before = model(probe)
                report = rebalance_experts(model, opt, min_gain=0.0)
                with torch.no_grad():
                    torch.testing.assert_close(model(probe), before, **TOL64)
            grads += [_step(model, opt, s, rank, world, replicas, micro, mesh) for s in (2, 3)]
            with torch.no_grad():
                y = model(probe)
            if replicas and path is not None and layout == layouts[0]:
                save_checkpoint(path, model, opt)
                out["saved"] = (y, _canonical(model))
            layouts_after = [m.expert_of_slot_S.tolist() for m in model[1::2]] if replicas else None
            runs[replicas] = (y, _canonical(model), grads, report, layouts_after)
        (ya, pa, ga, _, _), (yb, pb, gb, report, after) = runs[False], runs[True]
        torch.testing.assert_close(yb, ya, **TOL64)
        for step, (a, b) in enumerate(zip(ga, gb)):
            for name in a:
                torch.testing.assert_close(b[name], a[name], **TOL64, msg=f"{layout} {step} {name}")
        for name in pa:
            torch.testing.assert_close(pb[name], pa[name], **TOL64, msg=f"{layout} {name}")
        out[str(layout)] = {
            "moved": report.moved_experts,
            "copies": [p.copies for p in report.layers.values()],
            "after": after,
        }
    return out


def _check(results, world):
    for layout, r in results[0].items():
        assert r["moved"] > 0, layout
        for copies in r["copies"]:
            assert max(copies) > 1, (layout, copies)
        assert all(res[layout] == r for res in results), layout  # every rank: one placement


def test_replicas_exact_on_two_gloo_ranks():
    """ddp with two micro-batches per step, fsdp with the overlapped dispatcher, GroupedApply."""
    layouts = [
        (1, 2, "ddp", {"micro": 2}),
        (1, 2, "fsdp", {"overlap": 2}),
        (1, 2, "ddp", {"grouped": True}),
    ]
    _check(run_ranks(_run_body, 2, layouts, timeout=120), 2)


def _load_body(rank, world, path, spare):
    """Load the 4-rank replica checkpoint at ep = 2, with or without spare slots, then one
    step: the same as the model without replicas."""
    mesh = init_mesh(dp=1, ep=world)
    out = []
    for R in (0, spare):
        model = parallelize(_pair(R, seed=5)[R > 0], mesh, "fsdp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        load_checkpoint(path, model, opt)
        with torch.no_grad():
            y = model(_batch(99)[0])
        loaded = _canonical(model)
        _step(model, opt, 4, rank, world, R > 0, mesh=mesh)
        with torch.no_grad():
            out.append((y, loaded, model(_batch(99)[0]), _canonical(model)))
    return out


def test_replicas_exact_on_four_gloo_ranks(tmp_path):
    """... and the checkpoint saved with replicas at ep = 4 loads at ep = 2 with and without
    spare slots, and in one process."""
    path = str(tmp_path / "ckpt")
    layouts = [
        (1, 4, "ddp", {}),
        (2, 2, "fsdp", {}),
        (1, 4, "ddp", {"algorithm": "hierarchical", "ranks_per_node": 2}),
    ]
    results = run_ranks(_run_body, 4, layouts, path, timeout=180)
    saved_y, saved_params = results[0].pop("saved")
    for r in results[1:]:
        r.pop("saved")
    _check(results, 4)
    (plain, replicated) = run_ranks(_load_body, 2, path, 2, timeout=120)[0]
    for y, params, _, _ in (plain, replicated):
        torch.testing.assert_close(y, saved_y, **TOL64)
        for name, value in saved_params.items():
            torch.testing.assert_close(params[name], value, **TOL64, msg=name)
    torch.testing.assert_close(replicated[2], plain[2], **TOL64)  # one more step, both ways
    for name, value in plain[3].items():
        torch.testing.assert_close(replicated[3][name], value, **TOL64, msg=name)
    model = _pair(0, seed=7)[0]  # one process, no replicas
    load_checkpoint(path, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with torch.no_grad():
        torch.testing.assert_close(model(_batch(99)[0]), saved_y, **TOL64)


# -- bad input -----------------------------------------------------------------------------


def test_bad_spare_slots_and_layouts_are_refused_naming_layer_and_value():
    with pytest.raises(ValueError, match="spare_slots must be >= 0, got -1"):
        moe.MoELayer(D, F, E, spare_slots=-1)
    with pytest.raises(ValueError, match="token-choice router"):
        moe.MoELayer(D, F, E, router="expert_choice", capacity_factor=1.0, spare_slots=2)
    plain, rep = _pair(2)
    with pytest.raises(ValueError, match=r"1.expert_of_slot_S holds a replica layout of 10 slots"):
        plain.load_state_dict(rep.state_dict())
    bad = dict(rep.state_dict())
    bad["1.expert_of_slot_S"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 0, 1])  # no expert 7
    before = {k: v.clone() for k, v in rep.state_dict().items()}
    with pytest.raises(ValueError, match=r"moe: 1.expert_of_slot_S: .*no copy of experts \[7\]"):
        rep.load_state_dict(bad)
    assert all(torch.equal(v, before[k]) for k, v in rep.state_dict().items())  # unchanged


def _parallelize_body(rank, world, cases):
    """Each case on the same ranks (one start): the error each rank raised, or None."""
    out = []
    for spare, _ in cases:
        _, rep = _pair(spare)
        try:
            parallelize(rep, init_mesh(dp=1, ep=world), "ddp")
            if rank == 1:  # a rank with another replica layout: refused everywhere, nothing moves
                rep[1].expert_of_slot_S[[4, 8]] = rep[1].expert_of_slot_S[[8, 4]].clone()
            rebalance_experts(rep, None, min_gain=0.0)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append(None)
    return out


BAD_SPARE_SLOTS = [
    (3, "spare_slots=3 is not a multiple of the EP size 2"),
    (10, "spare_slots=10 needs more copies of an expert than there are EP ranks"),
    (2, "ranks hold different expert placements"),
]


def test_parallelize_refuses_bad_spare_slots_on_every_rank():
    results = run_ranks(_parallelize_body, 2, BAD_SPARE_SLOTS, timeout=30, deadline=90)
    for (spare, message), first, second in zip(BAD_SPARE_SLOTS, *results, strict=True):
        assert first == second and first is not None and message in first, (spare, message, first)


def test_replica_forward_backward_read_nothing():
    """The replica split adds no host read to the layer's forward and backward."""
    from tests.test_host_sync import layer_step_reads

    torch.manual_seed(0)
    layer = moe.MoELayer(24, 40, 6, top_k=2, capacity_factor=1.25, bias=True, spare_slots=2)
    calls = layer_step_reads(layer)
    assert calls == [], "\n".join(calls)
