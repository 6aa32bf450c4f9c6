"""Routing skew: how much more the busiest EP rank computes than the mean under a load-aware
placement, with and without copies of hot experts (moe.slots' spare slots), from a per-expert
load (a RoutingTrace's counts) or a Zipf skew parameter."""

from __future__ import annotations

import heapq
import math


def zipf_load(num_experts: int, skew: float) -> list[float]:
    """Expert loads proportional to 1 / (i + 1)^skew, summing to 1 (skew 0: uniform), in an
    order that spreads hot experts as a fixed arbitrary placement would (a seeded shuffle)."""
    if not math.isfinite(skew) or skew < 0:
        raise ValueError(f"skew must be a finite number >= 0, got {skew!r}")
    w = [1.0 / (i + 1) ** skew for i in range(num_experts)]
    order = sorted(range(num_experts), key=lambda i: (i * 2654435761) % 4294967296)
    total = sum(w)
    return [w[j] / total for j in order]


def check_load(load, num_experts: int) -> list[float]:
    """A per-expert load (any non-negative numbers, e.g. routed-token counts), normalised."""
    load = [float(x) for x in load]
    if len(load) != num_experts:
        raise ValueError(f"load has {len(load)} entries for {num_experts} experts")
    if any(not math.isfinite(x) or x < 0 for x in load) or sum(load) <= 0:
        raise ValueError("load must be finite, non-negative numbers with a positive sum")
    total = sum(load)
    return [x / total for x in load]


def imbalance(load: list[float], ep: int, spare_slots: int = 0) -> float:
    """max rank load / mean rank load over `ep` ranks once a load-aware placement (as
    moe.parallel.rebalance_experts makes) has packed the slots: the hottest experts get the
    spare slots (a multiple of ep) as copies that split their tokens evenly, then the shares
    go greedily, largest first, to the least-loaded rank with a free slot."""
    E = len(load)
    if ep <= 1:
        return 1.0
    copies = [1] * E
    for _ in range(spare_slots):  # one more copy for the expert with the largest share
        e = max(range(E), key=lambda i: load[i] / copies[i])
        copies[e] += 1
    shares = sorted(
        ((load[e] / copies[e]) for e in range(E) for _ in range(copies[e])), reverse=True
    )
    slots = len(shares) // ep
    heap = [(0.0, r, 0) for r in range(ep)]  # (load, rank, slots used)
    worst = 0.0
    for share in shares:
        total, r, used = heapq.heappop(heap)
        total += share
        worst = max(worst, total)
        if used + 1 < slots:
            heapq.heappush(heap, (total, r, used + 1))
    return worst * ep
