"""Dispatch: capacity, the sort-based plan of (token, expert) pairs, and the dispatchers that
move rows to the experts and back (one class per strategy, registered by name).

The uneven all-to-all lives in moe.comm; `moe.dispatch.all_to_all` stays here as its public
name.
"""

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
from moe.capacity import capacity_factor_for, expert_capacity
from moe.dispatch.dispatcher import (
    DISPATCHERS,
    DispatchContext,
    Dispatcher,
    ExpertFn,
    build_dispatcher,
    register_dispatcher,
)
from moe.dispatch.expert_parallel import ExpertParallelDispatcher
from moe.dispatch.local import LocalDispatcher
from moe.dispatch.overlap_degree import choose_degree, validate_overlap
from moe.dispatch.overlapped import OverlappedDispatcher
from moe.dispatch.permute import (
    DispatchPlan,
    gather_tokens,
    permute_rows,
    plan_expert_choice,
    plan_token_choice,
    sort_rows_by_expert,
    weighted_sum_rows,
)
