"""Replicas as a layout (issue 46 item 2; issue 49 item 5): callers of a slot layout never branch
on whether it holds copies, and ranks of an expert-parallel group holding different layouts
are refused at the first forward that would use them, on every rank, before any row moves."""

import ast
import pathlib

import pytest
import torch
from torch import nn

from moe import MoELayer
from moe.dispatch.permute import token_choice_rows
from moe.dispatch.replica_split import copy_candidates, replicated_rows, slot_rows
from moe.parallel import init_mesh, parallelize
from moe.parallel.rebalance import _transfers
from moe.slots.layout import SlotLayout
from moe.slots.placement import choose_placement
from moe.slots.replica_placement import choose_layout, choose_replicas
from tests.distributed import run_ranks

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "moe"
# Where knowing about copies is the point: the field and its validation, the layout, the guard.
ALLOWED = {"config.py", "slots/layout.py", "slots/guard.py"}
NAMES = {"has_copies", "spare_slots"}


def _mentions(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id in NAMES)
        or (isinstance(n, ast.Attribute) and n.attr in NAMES)
        for n in ast.walk(node)
    )


def copy_branches(source: str) -> list[int]:
    """Lines that read `.has_copies` / `.spare_slots`, mention `has_copies` at all, or branch
    (if, conditional expression, while, comprehension filter, assert) on either name."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in NAMES
            or isinstance(node, ast.Name)
            and node.id == "has_copies"
            or isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert))
            and _mentions(node.test)
        ):
            lines.add(node.lineno)
        elif isinstance(node, ast.comprehension) and any(_mentions(c) for c in node.ifs):
            lines.add(node.iter.lineno)
    return sorted(lines)


def test_the_check_finds_the_branches_it_bans():
    found = copy_branches(
        "if layer.has_copies:\n    pass\n"
        "x = [l for l in ls if l.config.spare_slots]\n"
        "def f(spare_slots=0):\n    return 1 if spare_slots else 0\n"
        "def g(spare_slots=0):\n    return h(spare_slots=spare_slots)\n"
    )
    assert found == [1, 3, 5]


def test_no_branch_on_copies_outside_config_layout_and_guard():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in ALLOWED:
            bad += [f"moe/{rel}:{line}" for line in copy_branches(path.read_text())]
    assert not bad, "branches on has_copies / spare_slots outside the layout:\n" + "\n".join(bad)


def test_identity_layout_is_a_no_op_of_every_layout_method():
    layout = SlotLayout.of_placement([2, 0, 1, 3])
    t = torch.arange(8.0).view(4, 2)
    layout.fill_copies(t)
    assert torch.equal(t, torch.arange(8.0).view(4, 2))
    assert layout.for_canonical_load() == SlotLayout.of_placement(range(4))
    assert SlotLayout(4, (0, 1, 2, 3, 0, 1)).for_canonical_load().num_slots == 6
    assert SlotLayout(4, (0, 1, 2, 3, 0, 1)).experts_read(3, 3) == (0, 4)
    assert layout.checksum() != SlotLayout.of_placement([0, 1, 2, 3]).checksum()


def _transfers_by_expert(old, new, ranges):
    """The per-expert moves rebalance_experts made for permutations before issue 46 (expert e
    from its old slot to its new one), kept as the reference for the slot-by-slot path."""
    holders = [[q for q, (lo, n) in enumerate(ranges) if lo <= s < lo + n] for s in range(len(old))]
    expert_of_slot = [0] * len(new)
    for e, s in enumerate(new):
        expert_of_slot[s] = e
    out = []
    for s in range(len(new)):
        src = old[expert_of_slot[s]]
        if src == s:
            continue
        for i, q in enumerate(holders[s]):
            h = holders[src][i % len(holders[src])]
            out.append((h, q, src - ranges[h][0], s - ranges[q][0]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_slot_by_slot_moves_of_a_permutation_are_the_per_expert_ones(seed):
    g = torch.Generator().manual_seed(seed)
    E, world = 8, [1, 2, 4][seed % 3]
    old, new = (torch.randperm(E, generator=g).tolist() for _ in range(2))
    L = E // world
    ranges = [(r * L, L) for r in range(world)] * (2 if seed % 2 else 1)  # "ddp": dp replicas
    by_slot = _transfers(
        SlotLayout.of_placement(old).expert_of_slot,
        SlotLayout.of_placement(new).expert_of_slot,
        ranges,
    )
    assert by_slot == _transfers_by_expert(old, new, ranges)


def test_one_planner_per_decision_a_permutation_planned_as_before():
    load = [9.0, 1.0, 1.0, 1.0, 7.0, 1.0, 2.0, 1.0]
    perm = SlotLayout.of_placement([3, 1, 2, 0, 4, 5, 6, 7])
    assert choose_layout(load, perm, 2, 0.0) == choose_placement(load, perm.slot_of_expert, 2, 0.0)
    copies = SlotLayout(8, (*range(8), 0, 1))
    assert choose_layout(load, copies, 2, 0.0) == choose_replicas(
        load, copies.expert_of_slot, 2, 0.0
    )


@pytest.mark.parametrize("capacity", [None, 3])
def test_the_slot_planner_is_each_plan_it_replaces(capacity):
    g = torch.Generator().manual_seed(1)
    T, K, E = 11, 2, 4
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g, dtype=torch.float64)
    slot_E = torch.tensor([2, 0, 3, 1])
    eos_S = torch.argsort(slot_E)
    slots = {"expert_of_slot_S": eos_S, "slot_of_expert_E": slot_E}
    got = slot_rows(ids_TK, w_TK, capacity=capacity, drop_policy="position", **slots)
    want = token_choice_rows(slot_E[ids_TK], w_TK, E, capacity, "position")
    for f in ("token_ids_M", "counts_E", "routed_E", "offsets_E", "weights_TK", "pair_rows_TK"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    eos_S = torch.tensor([0, 1, 2, 3, 0, 1])
    slot_E = torch.arange(E)
    cands = copy_candidates(eos_S, E, 0, 3, 2)
    slots = {"expert_of_slot_S": eos_S, "slot_of_expert_E": slot_E}
    got = slot_rows(ids_TK, w_TK, capacity=capacity, candidates=lambda *_: cands, **slots)
    want = replicated_rows(ids_TK, w_TK, capacity=capacity, candidates=cands, **slots)
    for f in ("token_ids_M", "counts_E", "routed_E", "offsets_E", "weights_TK", "pair_rows_TK"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


# Each case: (spare slots, layout keys rank 1 loads with a plain load_state_dict).
CASES = [
    (0, {"slot_of_expert_E": [2, 3, 0, 1]}),
    (2, {"slot_of_expert_E": [0, 1, 3, 2], "expert_of_slot_S": [0, 1, 3, 2, 0, 1]}),
]


def _forward(model, rank: int):
    """The error the forward raised on this rank, or None."""
    x = torch.randn(7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    try:
        model(x).sum().backward()
    except ValueError as e:
        return str(e)
    return None


def _layouts_body(rank, world, cases):
    out = []
    for spare, keys in cases:
        torch.manual_seed(0)
        layer = MoELayer(8, 12, 4, top_k=2, backend="torch", spare_slots=spare, dtype=torch.float64)
        model = nn.Sequential(layer)
        parallelize(model, init_mesh(dp=1, ep=world), "ddp")
        state = {f"0.{k}": torch.tensor(v) for k, v in keys.items()}
        before = _forward(model, rank)  # one layout on both ranks: runs
        if rank == 1:  # another layout on one rank only
            model.load_state_dict(state, strict=False)
        differ = _forward(model, rank)
        if rank == 0:  # now both hold the same one again: runs
            model.load_state_dict(state, strict=False)
        agree = _forward(model, rank)
        out.append((before, differ, agree))
    return out


def test_ranks_with_different_layouts_are_refused_before_the_forward_uses_them():
    """Issue 49 item 5: a plain load_state_dict of another layout on one rank used to run the
    next forward with tokens sent to the wrong experts (refused only at the next
    sum_replica_grads); the layout's checksum rides with the count exchange (no extra
    collective), so both ranks raise the same error before any row moves."""
    results = run_ranks(_layouts_body, 2, CASES, timeout=30, deadline=120)
    for case, first, second in zip(CASES, *results, strict=True):
        for before, differ, agree in (first, second):
            assert before is None and agree is None, (case, before, agree)
            assert differ is not None and "different slot layouts" in differ, (case, differ)
        assert first[1] == second[1], case  # the same message on every rank


@pytest.mark.parametrize("spare", [0, 2])
def test_state_dict_keys_are_those_every_version_wrote(spare):
    layer = MoELayer(8, 12, 4, backend="torch", spare_slots=spare)
    keys = {k for k in layer.state_dict() if k.endswith(("_of_expert_E", "_of_slot_S"))}
    assert keys == ({"slot_of_expert_E", "expert_of_slot_S"} if spare else {"slot_of_expert_E"})
