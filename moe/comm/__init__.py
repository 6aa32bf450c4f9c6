"""Communication between ranks: the uneven all-to-all (flat, hierarchical 2D), topology
detection, and the cross-rank consistency check."""

from moe.comm.alltoall import (
    AllToAllPlan,
    ExpertExchange,
    all_to_all,
    exchange,
    exchange_counts,
    gather_count_matrix,
    plan_all_to_all,
    plan_expert_exchange,
    cost_model,
    set_cost_model,
    set_hierarchical_threshold,
)
from moe.comm.cost_model import NVLINK_IB, CostModel, load_profile, save_profile
from moe.comm.consistency import check_same_across_ranks
from moe.comm.topology import Topology, get_topology
