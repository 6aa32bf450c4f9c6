"""The sort-based row map (which token feeds which expert row, with capacity drops) and the
row permutations built on it: gather_tokens / weighted_sum_rows, permute_rows and its inverse.

The T*k (token, expert) pairs are stably sorted by expert; kept pairs fill the first rows of
the expert-sorted buffer, dropped pairs sit at its tail (expert kernels output zero there).
No one-hot [T, E, C] tensor is ever built.
"""

from dataclasses import dataclass

import torch

from moe.capacity import count_ids
from moe.kernels.combine import combine_torch, sum_rows
from moe.kernels.registry import ExpertKernel


@dataclass
class RowMap:
    """Rows of the expert buffer: M = (token, expert) pairs, sorted by expert, kept rows first.
    E is every expert of the layer (global ids, also under expert parallelism)."""

    token_ids_M: torch.Tensor  # long [M]: source token of each row
    counts_E: torch.Tensor  # long [E]: kept rows per expert
    routed_E: torch.Tensor  # long [E]: pairs routed to each expert, before capacity drops
    offsets_E: torch.Tensor  # int32 [E]: cumulative row ends
    weights_TK: torch.Tensor | None  # fp32 [T, k]: combine weights, 0 for dropped pairs
    pair_rows_TK: torch.Tensor | None  # long [T, k]: buffer row of each pair (token choice)
    weights_M: torch.Tensor | None  # fp32 [M]: combine weight per row (expert choice)
    num_dropped: torch.Tensor  # long scalar: pairs dropped for capacity
    num_tokens: int
    # long [X]: the slot layout's checksum (MoELayer.slot_checksum_1), which expert-parallel
    # dispatchers send with the counts so every rank checks the group holds one layout (None:
    # a row map built outside a layer, nothing to check)
    layout_check_X: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.token_ids_M.shape[0]

    def row_weights(self) -> torch.Tensor:
        """fp32 [M]: the combine weight of each buffer row (differentiable in the router's
        weights), for experts that apply it themselves; dropped rows get 0."""
        if self.pair_rows_TK is None:
            return self.weights_M
        return self.weights_TK.new_empty(self.token_ids_M.shape[0]).index_copy(
            0, self.pair_rows_TK.reshape(-1), self.weights_TK.reshape(-1)
        )


def _sort_pairs(expert_ids_M, weights_M, policy):
    """Stable order of pairs by expert; within an expert by pair order or by weight."""
    if policy == "probs":
        by_weight = torch.argsort(weights_M, descending=True, stable=True)
        return by_weight[torch.argsort(expert_ids_M[by_weight], stable=True)]
    return torch.argsort(expert_ids_M, stable=True)


def token_choice_rows(
    expert_ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    drop_policy: str = "position",
    mask_TK: torch.Tensor | None = None,
) -> RowMap:
    """The row map of top-k style routing. Position priority is GShard's: every token's first
    choice is queued before any second choice, each in token order."""
    T, K = expert_ids_TK.shape
    E, device = num_experts, expert_ids_TK.device
    # Slot-major pair order p = j * T + t, so first choices come first.
    ids_M = expert_ids_TK.t().reshape(-1)
    if mask_TK is not None:  # pairs the router declined: sort to the tail, take no capacity
        ids_M = torch.where(mask_TK.t().reshape(-1), ids_M, E)
    order_M = _sort_pairs(ids_M, weights_TK.t().reshape(-1), drop_policy)
    sorted_ids_M = ids_M[order_M]
    routed_E = count_ids(sorted_ids_M, E + 1)[:E]
    if capacity is None:
        counts_E = routed_E
        keep_sorted_M = sorted_ids_M < E
    else:
        counts_E = routed_E.clamp(max=capacity)
        starts_E = torch.cumsum(routed_E, 0) - routed_E
        starts_M = torch.cat([starts_E, starts_E.new_zeros(1)])[sorted_ids_M]
        position_M = torch.arange(T * K, device=device) - starts_M
        keep_sorted_M = (position_M < capacity) & (sorted_ids_M < E)
        # Kept pairs first (stable, so still by expert), dropped to the tail.
        kept_first_M = torch.argsort((~keep_sorted_M).to(torch.int8), stable=True)
        order_M, keep_sorted_M = order_M[kept_first_M], keep_sorted_M[kept_first_M]
    rows_M = torch.empty_like(order_M)
    rows_M[order_M] = torch.arange(T * K, device=device)
    keep_M = torch.empty_like(keep_sorted_M)
    keep_M[order_M] = keep_sorted_M
    pair_rows_TK = rows_M.view(K, T).t()
    keep_TK = keep_M.view(K, T).t()
    token_ids_M = order_M % T
    num_dropped = (routed_E - counts_E).sum()
    return RowMap(
        token_ids_M=token_ids_M,
        counts_E=counts_E,
        routed_E=routed_E,
        offsets_E=torch.cumsum(counts_E, 0).to(torch.int32),
        weights_TK=weights_TK * keep_TK,
        pair_rows_TK=pair_rows_TK,
        weights_M=None,
        num_dropped=num_dropped,
        num_tokens=T,
    )


def expert_choice_rows(
    token_ids_EC: torch.Tensor, weights_EC: torch.Tensor, num_tokens: int
) -> RowMap:
    """The row map of expert choice: expert e's rows are its C chosen tokens; nothing is dropped."""
    E, C = token_ids_EC.shape
    counts_E = torch.full((E,), C, dtype=torch.long, device=token_ids_EC.device)
    return RowMap(
        token_ids_M=token_ids_EC.reshape(-1),
        counts_E=counts_E,
        routed_E=counts_E,
        offsets_E=torch.cumsum(counts_E, 0).to(torch.int32),
        weights_TK=None,
        pair_rows_TK=None,
        weights_M=weights_EC.reshape(-1),
        num_dropped=counts_E.new_zeros(()),
        num_tokens=num_tokens,
    )


class _GatherTokens(torch.autograd.Function):
    """x_MD = x_TD[token_ids_M]; backward sums each token's k row gradients (a gather-sum
    over the pair -> row map, deterministic, no zero-filled scatter-add)."""

    @staticmethod
    def forward(ctx, x_TD, token_ids_M, pair_rows_TK):
        ctx.save_for_backward(pair_rows_TK)
        return x_TD.index_select(0, token_ids_M)

    @staticmethod
    def backward(ctx, dx_MD):
        (pair_rows_TK,) = ctx.saved_tensors
        T, K = pair_rows_TK.shape
        rows_TKD = dx_MD.index_select(0, pair_rows_TK.reshape(-1)).view(T, K, dx_MD.shape[1])
        return rows_TKD.sum(1), None, None


def gather_tokens(x_TD: torch.Tensor, plan: RowMap) -> torch.Tensor:
    """The expert-sorted row buffer x_MD (row m holds token plan.token_ids_M[m])."""
    if plan.pair_rows_TK is None:
        return x_TD.index_select(0, plan.token_ids_M)
    return _GatherTokens.apply(x_TD, plan.token_ids_M, plan.pair_rows_TK)


def weighted_sum_rows(
    out_MD: torch.Tensor, plan: RowMap, kernel: ExpertKernel | None = None
) -> torch.Tensor:
    """The inverse of gather_tokens, weighted: y_TD[t] = sum of token t's rows times their
    combine weights. Token choice uses the gather-sum of the experts' kernel
    (`kernel.combine`; None: the torch op) over the pair -> row map; expert choice (a token
    may have 0..E rows) adds rows into their tokens."""
    if plan.pair_rows_TK is not None:
        combine = combine_torch if kernel is None else kernel.combine
        return combine(out_MD, plan.pair_rows_TK, plan.weights_TK)
    rows_MD = out_MD * plan.weights_M.to(out_MD.dtype).unsqueeze(1)
    return sum_rows(rows_MD, plan.token_ids_M, plan.num_tokens)


class _PermuteRows(torch.autograd.Function):
    """y_ND = x_ND[order_N]; backward applies the inverse permutation (a gather, no
    scatter-add). Calling it with (inverse_N, order_N) undoes it."""

    @staticmethod
    def forward(ctx, x_ND, order_N, inverse_N):
        ctx.save_for_backward(inverse_N)
        return x_ND.index_select(0, order_N)

    @staticmethod
    def backward(ctx, dy_ND):
        (inverse_N,) = ctx.saved_tensors
        return dy_ND.index_select(0, inverse_N), None, None


def sort_rows_by_expert(expert_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_N, inverse_N): the stable sort of rows by expert id, and its inverse."""
    order_N = torch.argsort(expert_N, stable=True)
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.shape[0], device=order_N.device)
    return order_N, inverse_N


def permute_rows(x_ND: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor):
    """x_ND[order_N], differentiable; permute_rows(y, inverse_N, order_N) is its inverse."""
    return _PermuteRows.apply(x_ND, order_N, inverse_N)


# the names before 2026-12-07, kept one release (CHANGELOG): "plan" is the layout planner's
DispatchPlan = RowMap
plan_token_choice = token_choice_rows
plan_expert_choice = expert_choice_rows
