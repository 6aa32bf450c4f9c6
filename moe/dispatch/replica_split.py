"""The row map over a slot layout (moe.slots.layout.SlotLayout): the one row mapper the layer
calls, for every layout. A layout without copies is a permutation: pairs are sorted by slot
directly (token_choice_rows on slot ids, the default path's cost). With copies: capacity, drops
and counts per expert, then each kept pair to one copy's slot.

A layer with spare slots holds S = E + R expert slots; expert e sits in every slot s with
expert_of_slot_S[s] == e. The T*k pairs are sorted and capped per canonical expert exactly as
token_choice_rows does (so drops, routing statistics and losses never see copies), then kept
pair number p of expert e (its position in that order) goes to candidate p mod n of e, where
the candidates are e's copies on the sending rank if any, else on its node, else all of them:
deterministic, the same rule on every rank, static shapes, no host sync. Rows are then sorted
by slot (kept first), which is the row map every dispatcher already takes.
"""

from collections.abc import Callable

import torch

from moe.capacity import count_ids
from moe.dispatch.permute import (
    RowMap,
    _sort_pairs,
    expert_choice_rows,
    token_choice_rows,
)

Candidates = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def slot_rows(
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    mask_TK: torch.Tensor | None = None,
    *,
    capacity: int | None,
    drop_policy: str = "position",
    expert_of_slot_S: torch.Tensor,
    slot_of_expert_E: torch.Tensor,
    candidates: Callable[[torch.Tensor, int], Candidates] | None = None,
    layout_check_X: torch.Tensor | None = None,
) -> RowMap:
    """Token-choice row map in slots from canonical expert ids, for any slot layout: capacity per
    expert, rows by slot. S == E (a permutation, no copies): token_choice_rows on slot ids,
    exactly as without replicas; S > E: replicated_rows, each kept pair to one of
    `candidates(expert_of_slot_S, E)` (the dispatcher's copy_candidates, asked only then;
    None: every copy on this rank). The static shapes choose: no sync."""
    E, S = slot_of_expert_E.numel(), expert_of_slot_S.numel()
    if S == E:
        ids_TK = slot_of_expert_E[expert_ids_TK]
        rows = token_choice_rows(ids_TK, weights_TK, E, capacity, drop_policy, mask_TK)
    else:
        choose = candidates or local_candidates
        rows = replicated_rows(
            expert_ids_TK,
            weights_TK,
            mask_TK,
            capacity=capacity,
            drop_policy=drop_policy,
            expert_of_slot_S=expert_of_slot_S,
            slot_of_expert_E=slot_of_expert_E,
            candidates=choose(expert_of_slot_S, E),
        )
    rows.layout_check_X = layout_check_X
    return rows


def expert_choice_slot_rows(
    token_ids_EC: torch.Tensor,
    weights_EC: torch.Tensor,
    num_tokens: int,
    *,
    slot_of_expert_E: torch.Tensor,
    layout_check_X: torch.Tensor | None = None,
) -> RowMap:
    """Expert-choice row map in slots: expert e's chosen tokens go to slot slot_of_expert_E[e]
    (expert choice has no copies: the layout is a permutation)."""
    ids_SC = torch.empty_like(token_ids_EC).index_copy_(0, slot_of_expert_E, token_ids_EC)
    weights_SC = torch.zeros_like(weights_EC).index_copy(0, slot_of_expert_E, weights_EC)
    rows = expert_choice_rows(ids_SC, weights_SC, num_tokens)
    rows.layout_check_X = layout_check_X
    return rows


def with_layout_check(rows: RowMap, extra: torch.Tensor | None) -> torch.Tensor | None:
    """The extra columns of an expert-parallel count exchange with the row map's layout checksum
    appended (moe.comm.exchange_expert_counts sends them to every rank with the counts)."""
    check = rows.layout_check_X
    if check is None:
        return extra
    return check if extra is None else torch.cat([extra.to(check), check])


def check_layouts_agree(rows: RowMap, extras_W) -> None:
    """After the count exchange, before any row moves: every rank of the group must hold the
    slot layout this one holds (the checksums each rank sent last in its extras). The same
    ValueError on every rank otherwise (each received every rank's checksum): no rank hangs."""
    check = rows.layout_check_X
    if check is None:
        return
    n = check.numel()
    sums = [tuple(e[len(e) - n :]) for e in extras_W]
    if len(set(sums)) > 1:
        seen = ", ".join(f"rank {r}: {s[0]:x}" for r, s in enumerate(sums[:8]))
        raise ValueError(
            "the ranks of the expert-parallel group hold different slot layouts "
            f"(expert_of_slot_S checksums {seen}), e.g. after load_state_dict on some ranks "
            "or with different state dicts; nothing was exchanged: load the same state on "
            "every rank (or through moe.checkpoint)"
        )


def copy_candidates(
    expert_of_slot_S: torch.Tensor,
    num_experts: int,
    rank: int,
    slots_per_rank: int,
    ranks_per_node: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order_S, first_E, count_E): expert e's candidate slots for a pair sent from `rank` are
    order_S[first_E[e] : first_E[e] + count_E[e]] (by slot)."""
    E, S = num_experts, expert_of_slot_S.numel()
    device = expert_of_slot_S.device
    slot_S = torch.arange(S, device=device)
    rank_S = slot_S // slots_per_rank
    score_S = 2 * (rank_S == rank).long() + (rank_S // ranks_per_node == rank // ranks_per_node)
    best_E = torch.full((E,), -1, dtype=torch.long, device=device)
    best_E = best_E.scatter_reduce(0, expert_of_slot_S, score_S, "amax")
    cand_S = score_S == best_E[expert_of_slot_S]
    count_E = torch.zeros(E, dtype=torch.long, device=device).index_add(
        0, expert_of_slot_S, cand_S.long()
    )
    key_S = (2 * expert_of_slot_S + (~cand_S).long()) * S + slot_S
    order_S = torch.argsort(key_S)
    copies_E = count_ids(expert_of_slot_S, E)
    first_E = torch.cumsum(copies_E, 0) - copies_E
    return order_S, first_E, count_E


def local_candidates(expert_of_slot_S: torch.Tensor, num_experts: int) -> Candidates:
    """copy_candidates with every slot on this one rank: all of an expert's copies."""
    S = expert_of_slot_S.numel()
    return copy_candidates(expert_of_slot_S, num_experts, 0, S, 1)


def replicated_rows(
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    mask_TK: torch.Tensor | None = None,
    *,
    capacity: int | None,
    drop_policy: str = "position",
    expert_of_slot_S: torch.Tensor,
    slot_of_expert_E: torch.Tensor,
    candidates: Candidates,
) -> RowMap:
    """token_choice_rows in canonical ids (capacity per expert), rows in copy slots. The map's
    counts_E are per slot; routed_E per slot counts the slot's kept rows plus, on each expert's
    first slot (slot_of_expert_E), its dropped pairs: summed over copies, the expert's."""
    T, K = expert_ids_TK.shape
    E, S = slot_of_expert_E.numel(), expert_of_slot_S.numel()
    device = expert_ids_TK.device
    ids_M = expert_ids_TK.t().reshape(-1)  # pair p = j * T + t: first choices first
    if mask_TK is not None:
        ids_M = torch.where(mask_TK.t().reshape(-1), ids_M, E)
    order_M = _sort_pairs(ids_M, weights_TK.t().reshape(-1), drop_policy)
    sorted_ids_M = ids_M[order_M]
    routed_E = count_ids(sorted_ids_M, E + 1)[:E]
    starts_E = torch.cumsum(routed_E, 0) - routed_E
    position_M = (
        torch.arange(T * K, device=device)
        - torch.cat([starts_E, starts_E.new_zeros(1)])[sorted_ids_M]
    )
    keep_sorted_M = sorted_ids_M < E
    counts_E = routed_E
    if capacity is not None:
        keep_sorted_M = keep_sorted_M & (position_M < capacity)
        counts_E = routed_E.clamp(max=capacity)
    order_S, first_E, count_E = candidates
    e_M = sorted_ids_M.clamp(max=E - 1)
    pick_M = first_E[e_M] + position_M % count_E[e_M]
    slot_M = torch.where(keep_sorted_M, order_S[pick_M], S)
    by_slot_M = torch.argsort(slot_M, stable=True)  # kept by slot, dropped at the tail
    order_M, slot_M, keep_sorted_M = order_M[by_slot_M], slot_M[by_slot_M], keep_sorted_M[by_slot_M]
    counts_S = count_ids(slot_M, S + 1)[:S]
    dropped_E = routed_E - counts_E
    routed_S = counts_S.index_add(0, slot_of_expert_E, dropped_E)
    rows_M = torch.empty_like(order_M)
    rows_M[order_M] = torch.arange(T * K, device=device)
    keep_M = torch.empty_like(keep_sorted_M)
    keep_M[order_M] = keep_sorted_M
    return RowMap(
        token_ids_M=order_M % T,
        counts_E=counts_S,
        routed_E=routed_S,
        offsets_E=torch.cumsum(counts_S, 0).to(torch.int32),
        weights_TK=weights_TK * keep_M.view(K, T).t(),
        pair_rows_TK=rows_M.view(K, T).t(),
        weights_M=None,
        num_dropped=dropped_E.sum(),
        num_tokens=T,
    )
