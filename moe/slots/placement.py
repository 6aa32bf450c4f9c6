"""Load-aware placement of E experts on W expert-parallel ranks, L = E / W per rank.

Pure host-side arithmetic on the per-expert load (identical input -> identical output on every
rank: no randomness, ties broken by index). Placement is a map slot_of_expert (expert e sits
in slot s = row s of the layer's stacked expert weights; rank r holds slots [r*L, (r+1)*L)).

    placement = choose_placement(load_E, slot_of_expert, num_ranks, min_gain=0.05)

1. LPT with a cardinality limit: experts by decreasing load, each to the least loaded rank
   that still has a free slot.
2. Pairwise swaps: while some swap of one expert of the most loaded rank with one expert of
   another rank lowers the larger of the two ranks' loads, make the best such swap.
3. The resulting W groups are matched to ranks to keep as many experts where they are as
   possible (an assignment problem on the overlap, solved exactly; then equally loaded experts
   swap where that lets one more stay), and an expert that stays on its rank keeps its slot,
   so only experts that change rank move.
4. If the largest rank load does not drop by at least `min_gain` (relative), the current
   placement is kept: weights do not move for nothing.
"""

from dataclasses import dataclass

from moe.slots.layout import SlotLayout


@dataclass(frozen=True)
class Placement:
    """A placement decision. slot_of_expert[e] is expert e's slot; `moved` lists the experts
    that change rank (empty when the current placement was kept)."""

    slot_of_expert: tuple[int, ...]
    max_before: float  # largest rank load under the current placement
    max_after: float  # ... under the returned placement
    mean: float  # mean rank load (the same for any placement)
    moved: tuple[int, ...]

    @property
    def changed(self) -> bool:
        return bool(self.moved)

    def layout(self, num_experts: int) -> SlotLayout:
        """The decision as the layer's slot layout value."""
        return SlotLayout.of_placement(self.slot_of_expert)


def rank_loads(load_E, slot_of_expert, num_ranks: int) -> list[float]:
    """Load per rank: the sum of the loads of the experts in its slots."""
    per_rank = len(slot_of_expert) // num_ranks
    out = [0.0] * num_ranks
    for e, s in enumerate(slot_of_expert):
        out[s // per_rank] += load_E[e]
    return out


def check_placement(slot_of_expert, num_experts: int) -> None:
    """slot_of_expert must be a permutation of range(num_experts)."""
    if sorted(slot_of_expert) != list(range(num_experts)):
        raise ValueError(
            f"slot_of_expert must be a permutation of 0..{num_experts - 1}, "
            f"got {list(slot_of_expert)[:16]}"
        )


def lpt_groups(load_E, num_ranks: int) -> list[list[int]]:
    """Longest processing time first with exactly E / W experts per group."""
    per_rank = len(load_E) // num_ranks
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0.0] * num_ranks
    for e in sorted(range(len(load_E)), key=lambda e: (-load_E[e], e)):
        r = min((r for r in range(num_ranks) if len(groups[r]) < per_rank), key=totals.__getitem__)
        groups[r].append(e)
        totals[r] += load_E[e]
    return groups


def improve_by_swaps(load_E, groups: list[list[int]], max_rounds: int | None = None) -> None:
    """In place: swap one expert of the most loaded group with one of another group while
    that lowers the larger of the two groups' loads (best swap first; ties by index). An
    expert never joins a group that already holds it (copies of one expert stay apart)."""
    totals = [sum(load_E[e] for e in g) for g in groups]
    for _ in range(max_rounds or 4 * len(load_E)):
        h = max(range(len(groups)), key=lambda r: (totals[r], -r))
        best = None  # (new larger load, group, i, j)
        for b in range(len(groups)):
            if b == h:
                continue
            for i, x in enumerate(groups[h]):
                for j, y in enumerate(groups[b]):
                    delta = load_E[x] - load_E[y]
                    if delta <= 0:
                        continue
                    worse = max(totals[h] - delta, totals[b] + delta)
                    if worse >= totals[h] or (best is not None and worse >= best[0]):
                        continue
                    if x not in groups[b] and y not in groups[h]:  # replicas: one copy a rank
                        best = (worse, b, i, j)
        if best is None:
            return
        _, b, i, j = best
        x, y = groups[h][i], groups[b][j]
        groups[h][i], groups[b][j] = y, x
        delta = load_E[x] - load_E[y]
        totals[h] -= delta
        totals[b] += delta


def max_overlap_assignment(overlap: list[list[int]]) -> list[int]:
    """rank_of_group maximising the summed overlap[group][rank] (Hungarian algorithm,
    O(W^3); exact, deterministic)."""
    n = len(overlap)
    big = max((v for row in overlap for v in row), default=0)
    cost = [[big - v for v in row] for row in overlap]  # minimise
    INF = float("inf")
    u, v = [0.0] * (n + 1), [0.0] * (n + 1)
    match, way = [0] * (n + 1), [0] * (n + 1)  # match[col] = row (1-based)
    for i in range(1, n + 1):
        match[0], j0 = i, 0
        minv, used = [INF] * (n + 1), [False] * (n + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = match[j0], INF, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if match[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    rank_of_group = [0] * n
    for j in range(1, n + 1):
        rank_of_group[match[j] - 1] = j - 1
    return rank_of_group


def slots_for(load_E, groups: list[list[int]], current: list[int]) -> tuple[int, ...]:
    """Give each group a rank (most experts staying), swap equally loaded experts where that
    lets one more stay, and give each expert a slot: experts staying on their rank keep their
    slot, incoming ones fill the freed slots in id order."""
    W, E = len(groups), len(current)
    L = E // W
    overlap = [[sum(current[e] // L == r for e in g) for r in range(W)] for g in groups]
    rank_of_group = max_overlap_assignment(overlap)
    on_rank = [[] for _ in range(W)]
    for g, experts in enumerate(groups):
        on_rank[rank_of_group[g]] = sorted(experts)
    swapped = True
    while swapped:  # each swap brings one more expert home: at most E rounds
        swapped = False
        for r in range(W):
            for i, x in enumerate(on_rank[r]):
                home = current[x] // L
                if home == r:
                    continue
                for j, y in enumerate(on_rank[home]):
                    if load_E[y] == load_E[x] and current[y] // L != home:
                        on_rank[r][i], on_rank[home][j] = y, x
                        swapped = True
                        break
    new = [-1] * E
    for r, experts in enumerate(on_rank):
        for e in experts:
            if current[e] // L == r:
                new[e] = current[e]
        free = sorted(set(range(r * L, (r + 1) * L)) - {new[e] for e in experts})
        for e, s in zip(sorted(e for e in experts if new[e] < 0), free):
            new[e] = s
    return tuple(new)


def choose_placement(load_E, slot_of_expert, num_ranks: int, min_gain: float = 0.05) -> Placement:
    """A placement of the E experts on `num_ranks` ranks (E / W each) minimising the largest
    rank load (LPT + pairwise swaps), or the current one when the largest load would drop by
    less than `min_gain` of it."""
    E = len(load_E)
    if num_ranks < 1 or E % num_ranks:
        raise ValueError(f"{E} experts cannot be split evenly over {num_ranks} ranks")
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    if any(not (x >= 0) for x in load_E):  # also NaN
        raise ValueError("expert loads must be non-negative numbers")
    current = [int(s) for s in slot_of_expert]
    check_placement(current, E)
    before = rank_loads(load_E, current, num_ranks)
    mean = sum(before) / num_ranks
    keep = Placement(tuple(current), max(before), max(before), mean, ())
    if num_ranks == 1 or max(before) == 0:
        return keep
    groups = lpt_groups(load_E, num_ranks)
    improve_by_swaps(load_E, groups)
    new = slots_for(load_E, groups, current)
    after = max(rank_loads(load_E, new, num_ranks))
    if after > max(before) * (1.0 - min_gain):
        return keep
    L = E // num_ranks
    moved = tuple(e for e in range(E) if new[e] // L != current[e] // L)
    return Placement(new, max(before), after, mean, moved)


# the name before 2026-12-07, kept one release (CHANGELOG): "plan" is the layout planner's
plan_placement = choose_placement
