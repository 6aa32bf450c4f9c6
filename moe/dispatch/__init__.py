"""Capacity, sort-based permutation, and the all-to-all exchange between expert ranks."""

from moe.dispatch.capacity import expert_capacity
from moe.dispatch.permute import (
    DispatchPlan,
    combine_rows,
    gather_tokens,
    plan_expert_choice,
    plan_token_choice,
)
from moe.dispatch.alltoall import (
    AllToAllPlan,
    all_to_all,
    exchange,
    exchange_counts,
    gather_count_matrix,
    plan_all_to_all,
    set_hierarchical_threshold,
)
from moe.dispatch.consistency import check_same_across_ranks
from moe.dispatch.topology import Topology, get_topology
