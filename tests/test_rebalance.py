"""Load-aware expert placement: the placement algorithm against a brute-force optimum, exact
application in one process (slot map) and on gloo ranks (ddp and fsdp, 2 and 4 ranks: outputs
unchanged, the next AdamW steps equal the run without re-placement, only moving experts are
sent), and checkpoints saved after a rebalance reloading at another layout and in one process."""

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import moe
from moe.checkpoint import load_checkpoint, save_checkpoint
from moe.parallel import init_mesh, parallelize
from moe.parallel.rebalance import rebalance_experts
from moe.slots.layout import SlotLayout
from moe.slots.placement import choose_placement, lpt_groups, rank_loads
from tests.distributed import run_ranks

D, F, E = 12, 20, 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _brute_force(load, W):
    """The optimal largest group load over all splits into W groups of E / W."""
    L, best = len(load) // W, float("inf")

    def split(rest, worst):
        nonlocal best
        if not rest:
            best = min(best, worst)
            return
        for others in itertools.combinations(rest[1:], L - 1):
            group = (rest[0], *others)
            w = max(worst, sum(load[e] for e in group))
            if w < best:
                split([e for e in rest if e not in group], w)

    split(list(range(len(load))), 0)
    return best


def test_placement_against_brute_force_optimum():
    rng = random.Random(0)
    optimal, total, worst_ratio = 0, 0, 1.0
    for E_, W in [(6, 3), (8, 4), (8, 2), (9, 3), (12, 4), (12, 6)]:
        for _ in range(60):
            load = [int(rng.paretovariate(1.2) * 10) for _ in range(E_)]
            p = choose_placement(load, list(range(E_)), W, min_gain=0.0)
            assert sorted(p.slot_of_expert) == list(range(E_))
            assert p.max_after == max(rank_loads(load, p.slot_of_expert, W))
            best = _brute_force(load, W)
            assert p.max_after >= best
            optimal += p.max_after == best
            total += 1
            worst_ratio = max(worst_ratio, p.max_after / best)
    assert optimal >= 0.95 * total, (optimal, total)
    assert worst_ratio <= 1.05


def test_swaps_fix_what_lpt_misses():
    load = [8, 7, 6, 5, 4, 0]  # LPT alone: {8, 5, 4} = 17 vs {7, 6, 0}; optimum 15
    assert max(sum(load[e] for e in g) for g in lpt_groups(load, 2)) == 17
    p = choose_placement(load, list(range(6)), 2)
    assert p.max_after == 15 == _brute_force(load, 2)


def test_placement_moves_only_what_it_must_and_keeps_small_gains():
    load = [10, 9, 1, 1, 1, 1, 1, 1]  # experts 0, 1 both on rank 0 of 4
    p = choose_placement(load, list(range(8)), 4)
    assert p.max_before == 19 and p.max_after == 11 and p.mean == 6.25
    # only expert 1 (or 0) has to leave rank 0, swapping with one expert of another rank
    assert len(p.moved) == 2
    for e in range(8):
        if e not in p.moved:
            assert p.slot_of_expert[e] == e  # stays in its slot
    again = choose_placement(load, p.slot_of_expert, 4)
    assert not again.changed and again.slot_of_expert == p.slot_of_expert
    small = choose_placement([10, 10, 9, 9], [0, 1, 2, 3], 2, min_gain=0.1)  # 20 -> 19: kept
    assert not small.changed and small.slot_of_expert == (0, 1, 2, 3)
    assert choose_placement([10, 10, 9, 9], [0, 1, 2, 3], 2, min_gain=0.0).max_after == 19
    with pytest.raises(ValueError, match="permutation"):
        choose_placement(load, [0, 0, 1, 2, 3, 4, 5, 6], 4)
    with pytest.raises(ValueError, match="evenly"):
        choose_placement(load, list(range(8)), 3)


def _place(layer, slot_of_expert):
    """Re-place a single-process layer's experts by hand: weights follow their slots."""
    slot_E = torch.tensor(slot_of_expert)
    assert sorted(slot_of_expert) == list(range(len(slot_of_expert)))
    with torch.no_grad():
        old_E = layer.slot_of_expert_E.clone()
        for p in layer.experts.parameters():
            rows = p.detach().clone()
            p[slot_E] = rows[old_E]
        layer.set_slot_layout(SlotLayout.of_placement(slot_of_expert))


@pytest.mark.parametrize(
    "options",
    [
        {"router": "topk", "capacity_factor": 1.0},
        {"router": "topk", "score_func": "sigmoid", "num_groups": 4, "topk_groups": 2},
        {"router": "expert_choice", "capacity_factor": 1.5},
        {"router": "prototype", "top_k": 2},
        {"router": "topk", "bias_update_rate": 0.1, "score_func": "sigmoid", "bias": True},
    ],
)
def test_single_process_placement_is_exact(options):
    options = {"top_k": 2, "aux_loss_coef": 0.01, **options}
    torch.manual_seed(0)
    a = moe.MoELayer(D, F, E, activation="swiglu", **options).double()
    b = moe.MoELayer(D, F, E, activation="swiglu", **options).double()
    b.load_state_dict(a.state_dict())
    if hasattr(a.router, "expert_bias"):
        with torch.no_grad():
            a.router.expert_bias.uniform_(-0.2, 0.2)
            b.router.expert_bias.copy_(a.router.expert_bias)
    _place(b, [5, 2, 7, 0, 3, 6, 1, 4])
    x = torch.randn(23, D, dtype=torch.float64)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(yb, ya)
    for key in ("tokens_per_expert", "routed_per_expert"):
        assert torch.equal(b.stats[key], a.stats[key]), key  # canonical expert ids
    assert torch.equal(b.load_since_rebalance, a.load_since_rebalance)
    (ya.square().sum() + a.aux_loss).backward()
    (yb.square().sum() + b.aux_loss).backward()
    torch.testing.assert_close(b.router.weight.grad, a.router.weight.grad)
    slot = b.slot_of_expert_E
    for (n, pa), pb in zip(a.experts.named_parameters(), b.experts.parameters()):
        torch.testing.assert_close(pb.grad[slot], pa.grad, msg=n)
    # the placement travels with the state dict and is checked when read back
    c = moe.MoELayer(D, F, E, activation="swiglu", **options).double()
    c.load_state_dict(b.state_dict())
    torch.testing.assert_close(c(x), ya)
    bad = {**b.state_dict(), "slot_of_expert_E": torch.tensor([0, 0, 1, 2, 3, 4, 5, 6])}
    with pytest.raises(ValueError, match="permutation"):
        c.load_state_dict(bad)
    old = {k: v for k, v in a.state_dict().items() if k != "slot_of_expert_E"}
    c.load_state_dict(old)  # saved before placements existed: canonical order
    assert torch.equal(c.slot_of_expert_E, torch.arange(E))


def test_load_count_training_only_not_twice_under_checkpointing():
    torch.manual_seed(0)
    layer = moe.MoELayer(D, F, E, top_k=2, capacity_factor=1.0, recompute=True)
    x = torch.randn(17, D, requires_grad=True)
    layer(x).sum().backward()
    first = layer.load_since_rebalance.clone()
    assert int(first.sum()) == int(layer.stats["tokens_per_expert"].sum())  # kept rows
    layer.eval()
    layer(x)
    assert torch.equal(layer.load_since_rebalance, first)
    layer.train()
    layer(x).sum().backward()
    assert torch.equal(layer.load_since_rebalance, 2 * first)
    with pytest.raises(ValueError, match="min_gain"):
        rebalance_experts(layer, min_gain=1.5)
    assert torch.equal(layer.load_since_rebalance, 2 * first)  # refused before any change
    report = rebalance_experts(layer)  # one process: nothing to place, the count restarts
    assert not report.layers and layer.load_since_rebalance is None


def _model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(D, D),
        moe.MoELayer(D, F, E, top_k=2, aux_loss_coef=0.0, capacity_factor=1.5),
        torch.nn.Linear(D, D),
        moe.MoELayer(D, F, E, top_k=1, aux_loss_coef=0.0),
    )
    with torch.no_grad():  # hot experts 0 and 1: both in the first EP block
        for layer in (model[1], model[3]):
            layer.router.weight[:2] *= 4.0
    return model


def _batch(step, n=24):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def _step(model, opt, step, rank, world):
    x, y = _batch(step)
    rows = x.shape[0] // world
    x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
    loss = (model(x) - y).square().sum() * world / (x.shape[0] * world * D)
    loss.backward()
    opt.step()
    opt.zero_grad()


@torch.no_grad()
def _probe(model, x):
    """Outputs on a fixed batch (no autograd graph: FSDP2 expects a backward after one)."""
    return model(x)


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _canonical(model):
    """Every parameter in canonical expert order (expert rows read through the placement)."""
    out = {}
    for name, p in model.named_parameters():
        full = _full(p)
        owner = model.get_submodule(name.rsplit(".experts.", 1)[0]) if ".experts." in name else None
        out[name] = full[owner.slot_of_expert_E] if owner is not None else full
    return out


def _count_all_to_all(calls):
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        calls.append(input.numel() * input.element_size())
        return original(output, input, output_split_sizes, input_split_sizes, **kw)

    return original, counting


def _layout_body(rank, world, layouts, path):
    results = {}
    probe = _batch(99)[0]  # the same global batch on every rank: the single-process output
    for layout in layouts:
        dp, ep, mode, *grouped = layout
        mesh = init_mesh(dp=dp, ep=ep)
        runs = {}
        for rebalance in (False, True):
            model = parallelize(_model(), mesh, mode)
            if grouped:  # moe's grouped optimizer apply: state read through state_of
                opt = moe.memory.GroupedApply(
                    model.parameters(), torch.optim.AdamW, groups=2, lr=1e-2, weight_decay=0.1
                )
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            for step in (0, 1):
                _step(model, opt, step, rank, world)
            before = _probe(model, probe)
            report, sent = None, []
            if rebalance:
                original, counting = _count_all_to_all(sent)
                dist.all_to_all_single = counting
                try:
                    report = rebalance_experts(model, opt, min_gain=0.0)
                finally:
                    dist.all_to_all_single = original
                after = _probe(model, probe)
                torch.testing.assert_close(after, before, **TOL)
                if path is not None and layout == layouts[0]:
                    save_checkpoint(path, model, opt)
                    results["saved_out"] = after
                    results["saved_slots"] = [m.slot_of_expert_E.tolist() for m in model[1::2]]
            for step in (2, 3):
                _step(model, opt, step, rank, world)
            runs[rebalance] = (_probe(model, probe), _canonical(model), report, sent)
        (out_a, params_a, _, _), (out_b, params_b, report, sent) = runs[False], runs[True]
        torch.testing.assert_close(out_b, out_a, **TOL)
        for name, value in params_a.items():
            torch.testing.assert_close(params_b[name], value, **TOL, msg=name)
        # only the moving experts' rows travel: weights + exp_avg + exp_avg_sq, 4 bytes each
        per_expert = {
            i: sum(p[0].numel() * 4 * 3 for p in model_layer.experts.parameters())
            for i, model_layer in ((1, _model()[1]), (3, _model()[3]))
        }
        moved = {i: len(report.layers[str(i)].moved) for i in (1, 3)}
        total = torch.tensor([sum(sent), report.bytes_sent])
        dist.all_reduce(total)
        replicas = dp if mode == "ddp" else 1
        expected = replicas * sum(moved[i] * per_expert[i] for i in (1, 3))
        results[layout] = {
            "moved": moved,
            "bytes": total.tolist(),
            "expected": expected,
            "all": replicas * E * (per_expert[1] + per_expert[3]),
            "ratio": [
                (p.max_before / p.mean, p.max_after / p.mean) for p in report.layers.values()
            ],
        }
    return results


def _load_body(rank, world, layouts, load_layout, path):
    results = _layout_body(rank, world, layouts, None)
    dp, ep, mode = load_layout
    model = parallelize(_model(seed=3), init_mesh(dp=dp, ep=ep), mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    load_checkpoint(path, model, opt)
    slots = [m.slot_of_expert_E.tolist() for m in model[1::2]]
    out = _probe(model, _batch(99)[0])
    if rank == 1:  # a rank with another placement: the same error everywhere, no hang
        model[1].set_slot_layout(SlotLayout.of_placement(slots[0][::-1]))
    with pytest.raises(ValueError, match="different expert placements"):
        rebalance_experts(model, opt)
    return results, out, slots


def _check_layouts(results, layouts):
    for layout in layouts:
        r = results[layout]
        assert sum(r["moved"].values()) > 0, layout
        assert r["bytes"][0] == r["bytes"][1] == r["expected"], (layout, r)
        assert r["expected"] < r["all"], layout
        for before, after in r["ratio"]:
            assert after < before, (layout, r["ratio"])


def test_rebalance_on_gloo_ranks_and_checkpoint_at_other_layouts(tmp_path):
    """4 ranks: ddp (1, 4), saving after the rebalance, fsdp and ddp (2, 2); 2 ranks: ddp (1, 2)
    with GroupedApply, and the checkpoint loaded at fsdp (1, 2); then in one process."""
    path = str(tmp_path / "ckpt")
    layouts = [(1, 4, "ddp"), (2, 2, "fsdp"), (2, 2, "ddp")]
    results = run_ranks(_layout_body, 4, layouts, path, timeout=120)[0]
    _check_layouts(results, layouts)
    saved_out, saved_slots = results["saved_out"], results["saved_slots"]
    assert any(s != list(range(E)) for s in saved_slots)
    small = [(1, 2, "ddp", "grouped")]
    results, out, slots = run_ranks(_load_body, 2, small, (1, 2, "fsdp"), path, timeout=120)[0]
    _check_layouts(results, small)
    assert slots == saved_slots
    torch.testing.assert_close(out, saved_out, **TOL)
    model = _model(seed=3)  # one process
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    load_checkpoint(path, model, opt)
    torch.testing.assert_close(_probe(model, _batch(99)[0]), saved_out, **TOL)


def test_hf_export_in_canonical_order_after_placement(tmp_path):
    """to_hf and save_hf_checkpoint write canonical experts; load_hf_checkpoint into a placed
    model reads them back (placement reset to canonical)."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_parity import fresh

    reference = fresh("qwen2_moe")
    ids = torch.randint(0, 97, (2, 9))
    expected = reference.eval()(ids).logits
    model = moe.from_hf(fresh("qwen2_moe")).eval()
    for layer in (m for _, m in moe.moe_layers(model)):
        E_ = layer.config.num_experts
        _place(layer, list(reversed(range(E_))))
        assert layer.slot_of_expert_E.tolist() != list(range(E_))
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-6)
    moe.save_hf_checkpoint(model, str(tmp_path / "out"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    torch.testing.assert_close(again.eval()(ids).logits, expected, rtol=1e-5, atol=1e-6)
    placed = moe.from_hf(fresh("qwen2_moe")).eval()
    for layer in (m for _, m in moe.moe_layers(placed)):
        _place(layer, [(e + 2) % layer.config.num_experts for e in range(layer.config.num_experts)])
    moe.load_hf_checkpoint(placed, str(tmp_path / "out"))
    torch.testing.assert_close(placed(ids).logits, expected, rtol=1e-5, atol=1e-6)
    exported = moe.to_hf(model)
    torch.testing.assert_close(exported(ids).logits, expected, rtol=1e-5, atol=1e-6)


def test_checkpoint_without_placement_loads_in_canonical_order(tmp_path):
    old = _model(seed=1)
    for layer in old[1::2]:  # as saved before placements existed: no slot_of_expert_E key
        layer._state_dict_hooks.clear()
    save_checkpoint(str(tmp_path / "old"), old)
    model = _model(seed=2)
    for layer in model[1::2]:
        _place(layer, list(reversed(range(E))))
    load_checkpoint(str(tmp_path / "old"), model)
    assert all(m.slot_of_expert_E.tolist() == list(range(E)) for m in model[1::2])
    torch.testing.assert_close(_probe(model, _batch(5)[0]), _probe(old, _batch(5)[0]))
