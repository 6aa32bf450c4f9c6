"""Local dispatch: capacity and the sort-based permutation of (token, expert) pairs.

The expert exchange between ranks lives in moe.comm; `moe.dispatch.all_to_all` stays here as
the public name of the uneven all-to-all.
"""

from moe.dispatch.capacity import expert_capacity
from moe.dispatch.permute import (
    DispatchPlan,
    combine_rows,
    gather_tokens,
    plan_expert_choice,
    plan_token_choice,
)
from moe.comm import (
    AllToAllPlan,
    Topology,
    all_to_all,
    check_same_across_ranks,
    exchange,
    exchange_counts,
    gather_count_matrix,
    get_topology,
    plan_all_to_all,
    set_hierarchical_threshold,
)
