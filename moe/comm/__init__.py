"""Communication between ranks: the uneven all-to-all (flat, hierarchical 2D), topology
detection, and the cross-rank consistency check.

The one-call all-to-all's public path is `moe.dispatch.all_to_all`.
"""

from moe.comm.alltoall import (
    AllToAllPlan,
    AllToAllSplits,
    exchange,
    exchange_counts,
    gather_count_matrix,
    cost_model,
)
from moe.comm.exchange_config import ExchangeConfig, set_cost_model, set_hierarchical_threshold
from moe.comm.expert_exchange import (
    ExpertExchange,
    all_to_all_splits,
    exchange_expert_counts,
    plan_all_to_all,
)
from moe.comm.cost_model import NVLINK_IB, CostModel, load_profile, save_profile
from moe.comm.consistency import (
    CrossRankError,
    check_same_across_ranks,
    raise_if_any_rank_failed,
    same_error_on_every_rank,
)
from moe.comm.topology import Topology, get_topology
