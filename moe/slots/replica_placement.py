"""Placement with replicas: E experts in S = E + R slots on W expert-parallel ranks (L = S / W
slots per rank), hot experts in several slots on different ranks.

Pure host-side arithmetic on the per-expert load, deterministic (ties by index), so every rank
computes the same answer. A placement is `expert_of_slot` (slot s = row s of the layer's stacked
expert weights holds a copy of expert expert_of_slot[s]; rank r holds slots [r*L, (r+1)*L)).
A replicated expert's pairs are split over its copies, so each copy carries load / copies.

    placement = choose_replicas(load_E, expert_of_slot, num_ranks, min_gain=0.05)

1. Copies: every expert one; each of the R spare slots goes to the expert with the largest
   load per copy (at most W copies), which is exactly the allocation minimising the largest
   load per copy (the `bound` below, over the mean).
2. LPT over the copies by load per copy: each to the least loaded rank with a free slot that
   holds no copy of the same expert (a stuck copy swaps in through a full rank).
3. Pairwise swaps of copies between the most loaded rank and another while that lowers the
   larger of the two (never two copies of one expert on one rank).
4. Groups are matched to ranks keeping the most slots' experts where they are (assignment on
   the overlap), and a slot whose expert stays keeps it: only the slots that change move.
5. If the largest rank load does not drop by at least `min_gain` (relative), nothing changes.
"""

import heapq
from dataclasses import dataclass

from moe.slots.layout import (
    SlotLayout,
    check_replica_placement,
    copies_of,
    primary_slots,
)
from moe.slots.placement import (
    Placement,
    choose_placement,
    improve_by_swaps,
    max_overlap_assignment,
)


@dataclass(frozen=True)
class ReplicaPlacement:
    """A decision. expert_of_slot[s]: the expert slot s copies; `moved_slots` lists the slots
    whose expert changes (empty when the current placement was kept)."""

    expert_of_slot: tuple[int, ...]
    max_before: float  # largest rank load under the current placement
    max_after: float  # ... under the returned one
    mean: float  # mean rank load
    bound: float  # the largest load per copy of the best copy counts (a lower bound is max(mean, bound))
    moved_slots: tuple[int, ...]

    @property
    def changed(self) -> bool:
        return bool(self.moved_slots)

    @property
    def moved(self) -> tuple[int, ...]:
        """The slots that change (RebalanceReport counts them as moved experts)."""
        return self.moved_slots

    @property
    def copies(self) -> tuple[int, ...]:
        return copies_of(self.expert_of_slot, max(self.expert_of_slot) + 1)

    @property
    def slot_of_expert(self) -> tuple[int, ...]:
        return primary_slots(self.expert_of_slot, max(self.expert_of_slot) + 1)

    def layout(self, num_experts: int) -> SlotLayout:
        """The decision as the layer's slot layout value."""
        return SlotLayout(num_experts, tuple(self.expert_of_slot))


def rank_loads(load_E, expert_of_slot, num_ranks: int) -> list[float]:
    """Load per rank: each copy of expert e carries load_E[e] / copies of e."""
    copies = copies_of(expert_of_slot, len(load_E))
    L = len(expert_of_slot) // num_ranks
    out = [0.0] * num_ranks
    for s, e in enumerate(expert_of_slot):
        out[s // L] += load_E[e] / copies[e]
    return out


def choose_copies(load_E, num_slots: int, num_ranks: int) -> list[int]:
    """Copies per expert: the spare slots go one by one to the largest load per copy."""
    E = len(load_E)
    if num_slots - E > E * (num_ranks - 1):
        raise ValueError(
            f"{num_slots - E} spare slots need more copies than there are ranks "
            f"({E} experts x at most {num_ranks} copies)"
        )
    copies = [1] * E
    heap = [(-load_E[e], e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(num_slots - E):
        while True:
            _, e = heapq.heappop(heap)
            if copies[e] < num_ranks:
                break
        copies[e] += 1
        if copies[e] < num_ranks:
            heapq.heappush(heap, (-load_E[e] / copies[e], e))
    return copies


def lpt_with_copies(load_E, copies, num_ranks: int) -> list[list[int]]:
    """LPT over the copies (weight load / copies), L per rank, one copy of an expert per rank."""
    L = sum(copies) // num_ranks
    items = sorted(
        ((load_E[e] / copies[e], e) for e in range(len(load_E)) for _ in range(copies[e])),
        key=lambda t: (-t[0], t[1]),
    )
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0.0] * num_ranks
    for w, e in items:
        free = [r for r in range(num_ranks) if len(groups[r]) < L and e not in groups[r]]
        if free:
            r = min(free, key=lambda r: (totals[r], r))
        else:  # every rank with a free slot holds e: bring one copy x over from a full rank
            r_free = next(r for r in range(num_ranks) if len(groups[r]) < L)
            r = next(q for q in range(num_ranks) if e not in groups[q])
            x = next(x for x in groups[r] if x not in groups[r_free])
            groups[r].remove(x)
            groups[r_free].append(x)
            wx = load_E[x] / copies[x]
            totals[r] -= wx
            totals[r_free] += wx
        groups[r].append(e)
        totals[r] += w
    return groups


def improve_copies_by_swaps(load_E, copies, groups: list[list[int]]) -> None:
    """In place: swap one copy of the most loaded rank with one of another rank while that
    lowers the larger of the two loads (placement.improve_by_swaps over load per copy; never
    two copies on one rank)."""
    per_copy = [load_E[e] / copies[e] for e in range(len(load_E))]
    improve_by_swaps(per_copy, groups, max_rounds=4 * sum(copies))


def slots_for_groups(groups: list[list[int]], current: list[int]) -> tuple[int, ...]:
    """Give each group a rank (most slots keeping their expert), then each copy a slot: a slot
    whose expert is still wanted on its rank keeps it; the others take the rest in id order."""
    W, S = len(groups), len(current)
    L = S // W
    held = [current[r * L : (r + 1) * L] for r in range(W)]
    overlap = [
        [sum(min(g.count(e), held[r].count(e)) for e in set(g)) for r in range(W)] for g in groups
    ]
    rank_of_group = max_overlap_assignment(overlap)
    new = [-1] * S
    for g, experts in enumerate(groups):
        r = rank_of_group[g]
        wanted = sorted(experts)
        for s in range(r * L, (r + 1) * L):
            if current[s] in wanted:
                new[s] = current[s]
                wanted.remove(current[s])
        free = [s for s in range(r * L, (r + 1) * L) if new[s] < 0]
        for s, e in zip(free, wanted):
            new[s] = e
    return tuple(new)


def choose_replicas(
    load_E, expert_of_slot, num_ranks: int, min_gain: float = 0.05
) -> ReplicaPlacement:
    """A placement of E experts in the current number of slots on `num_ranks` ranks
    minimising the largest rank load, or the current one when it would drop by less than
    `min_gain` of it."""
    E, S = len(load_E), len(expert_of_slot)
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    if any(not (x >= 0) for x in load_E):  # also NaN
        raise ValueError("expert loads must be non-negative numbers")
    current = [int(e) for e in expert_of_slot]
    check_replica_placement(current, E, num_ranks)
    copies = choose_copies(load_E, S, num_ranks)
    before = rank_loads(load_E, current, num_ranks)
    mean = sum(before) / num_ranks
    bound = max((load_E[e] / copies[e] for e in range(E)), default=0.0)
    keep = ReplicaPlacement(tuple(current), max(before), max(before), mean, bound, ())
    if num_ranks == 1 or max(before) == 0:
        return keep
    groups = lpt_with_copies(load_E, copies, num_ranks)
    improve_copies_by_swaps(load_E, copies, groups)
    new = slots_for_groups(groups, current)
    after = max(rank_loads(load_E, new, num_ranks))
    if after > max(before) * (1.0 - min_gain):
        return keep
    moved = tuple(s for s in range(S) if new[s] != current[s])
    return ReplicaPlacement(new, max(before), after, mean, bound, moved)


def choose_layout(
    load_E, layout: SlotLayout, num_ranks: int, min_gain: float = 0.05
) -> "Placement | ReplicaPlacement":
    """A layer's next slot layout from its experts' loads, for any layout (the one planner
    moe.parallel.rebalance_experts calls): S == E slots, a permutation, is planned as a
    placement (choose_placement: whole experts change rank); S > E by choose_replicas (which
    experts the spare slots copy is decided too). Either decision's .layout(E) is a SlotLayout."""
    if layout.num_slots == layout.num_experts:
        return choose_placement(load_E, layout.slot_of_expert, num_ranks, min_gain)
    return choose_replicas(load_E, layout.expert_of_slot, num_ranks, min_gain)


# the name before 2026-12-07, kept one release (CHANGELOG): "plan" is the layout planner's
plan_replicas = choose_replicas
