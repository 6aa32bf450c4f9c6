"""Expert capacity and id counting: the arithmetic both routing and dispatch need.

Why a module of its own, below `moe.gating` and `moe.dispatch`: expert choice (a router)
picks C tokens per expert and token-choice dispatch drops pairs past C, so both stages need
the same capacity formula, and the router losses and the dispatch plan both count ids per
expert. Kept in either stage, the other would import it sideways (loading a router would
load the dispatchers and moe.comm). This module imports only torch, so every stage may
import it. `moe.dispatch` re-exports `capacity_factor_for` and `expert_capacity`.
"""

import math

import torch


def capacity_factor_for(config, training: bool) -> float | None:
    """The capacity factor in force: `eval_capacity_factor` in eval mode when set, else
    `capacity_factor`. The one place this choice is made (token and expert choice alike)."""
    if not training and config.eval_capacity_factor is not None:
        return config.eval_capacity_factor
    return config.capacity_factor


def expert_capacity(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float | None,
    min_capacity: int = 4,
) -> int | None:
    """C = ceil(capacity_factor * k * T / E), at least min_capacity, at most T; None = dropless.

    The one capacity formula of every router: token choice takes it with the layer's k and
    `min_capacity`; expert choice (each expert takes C tokens, each token at most once) with
    k = 1 and min_capacity = 0, i.e. C = min(T, ceil(capacity_factor * T / E)).

    Computed from shapes only (no device values), so every rank that sees the same T computes
    the same C. MoEConfig bounds the factor (<= 1e4); a product past T (even inf) is T here
    rather than an OverflowError from ceil.
    """
    if capacity_factor is None:
        return None
    raw = capacity_factor * top_k * num_tokens / num_experts
    capacity = math.ceil(raw) if raw < num_tokens else num_tokens
    return min(max(capacity, min_capacity), num_tokens)


def count_ids(ids: torch.Tensor, num: int) -> torch.Tensor:
    """long [num]: how many of `ids` (long, each in [0, num)) equal each value. bincount's
    output shape depends on the data (a graph break under torch.compile); this one's does not."""
    counts = torch.zeros(num, dtype=torch.long, device=ids.device)
    return counts.index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
