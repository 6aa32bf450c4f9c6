"""The spare-slot planner (moe.slots.replica_placement.choose_replicas) against bounds computed
from the loads alone (issue 62 item 15), not from its own output: on tiny instances every
placement of E experts in S = E + R slots on W ranks (each expert at least once, never twice
on one rank) is enumerated for the optimal largest rank load, and every copy count vector for
the best largest load per copy. The planner's placement is never below the optimum, reaches
it on most instances and stays within 25% of it on every one (as measured 2026-12-07: optimal
on 92 of 150, worst 1.22x: LPT over the copy counts that minimise the load per copy is a
heuristic, not an optimum), and the bound it reports is the enumerated one."""

import itertools
import math
import random

from moe.slots.layout import initial_expert_of_slot
from moe.slots.replica_placement import choose_replicas, rank_loads

CASES = [(4, 2, 2), (5, 3, 1), (6, 2, 2), (6, 3, 3), (4, 4, 4), (6, 2, 4)]  # (E, W, R)


def optimum(load, W: int, S: int) -> float:
    """The smallest largest rank load over every placement: W ranks of S / W distinct experts
    each, every expert held at least once, each copy carrying load / copies."""
    E, L, best = len(load), S // W, float("inf")
    groups = list(itertools.combinations(range(E), L))
    for pick in itertools.combinations_with_replacement(range(len(groups)), W):
        copies = [0] * E
        for g in pick:
            for e in groups[g]:
                copies[e] += 1
        if min(copies) == 0:
            continue
        worst = max(sum(load[e] / copies[e] for e in groups[g]) for g in pick)
        best = min(best, worst)
    return best


def best_per_copy(load, W: int, S: int) -> float:
    """The smallest largest load per copy over every copy count vector (1..W copies each,
    S in all)."""
    E = len(load)
    return min(
        max(x / c for x, c in zip(load, copies))
        for copies in itertools.product(range(1, W + 1), repeat=E)
        if sum(copies) == S
    )


def test_planner_meets_the_enumerated_optimum():
    rng = random.Random(1)
    optimal = total = 0
    worst = 1.0
    for E, W, R in CASES:
        for _ in range(25):
            load = [int(rng.paretovariate(1.1) * 10) + rng.choice((0, 1)) for _ in range(E)]
            p = choose_replicas(load, initial_expert_of_slot(E, R), W, min_gain=0.0)
            assert abs(max(rank_loads(load, p.expert_of_slot, W)) - p.max_after) < 1e-9
            opt = optimum(load, W, E + R)
            assert p.max_after >= opt - 1e-9, (load, W, R)
            assert abs(p.bound - best_per_copy(load, W, E + R)) < 1e-9, (load, W, R)
            assert max(p.bound, p.mean) <= opt + 1e-9
            optimal += p.max_after <= opt + 1e-9
            total += 1
            worst = max(worst, p.max_after / opt if opt else 1.0)
    assert optimal >= 0.55 * total, (optimal, total)
    assert worst <= 1.25, worst


def lower_bound(load, W: int, S: int) -> float:
    """From the loads alone: no placement beats the mean rank load, nor the smallest tau for
    which copies of at most tau each fit in S slots (ceil(load / tau) copies, at most W)."""
    lo, hi = 0.0, max(load)
    for _ in range(200):  # bisection on tau
        tau = (lo + hi) / 2
        need = [max(1, math.ceil(x / tau - 1e-12)) for x in load]
        lo, hi = (lo, tau) if sum(need) <= S and max(need) <= W else (tau, hi)
    return max(hi, sum(load) / W)


def test_planner_near_the_load_bound_at_larger_sizes():
    """Pareto loads (alpha 1.2) at E 16-64, W 4-8: the largest rank load over the bound,
    deterministic (seeded): as measured 2026-12-07 mean 1.0151, median 1.0015; LPT to the
    fullest rank gives 1.0196 / 1.0031, no swaps 1.0236 / 1.0084, copies by total load 1.0440."""
    rng = random.Random(2)
    ratios = []
    for E, W, R in [(16, 4, 4), (32, 8, 8), (64, 8, 8), (64, 8, 16), (24, 6, 6), (48, 8, 8)]:
        for _ in range(10):
            load = [rng.paretovariate(1.2) for _ in range(E)]
            p = choose_replicas(load, initial_expert_of_slot(E, R), W, min_gain=0.0)
            bound = lower_bound(load, W, E + R)
            assert p.max_after >= bound * (1 - 1e-9)
            ratios.append(p.max_after / bound)
    ratios.sort()
    assert sum(ratios) / len(ratios) <= 1.017 and ratios[len(ratios) // 2] <= 1.002, ratios
