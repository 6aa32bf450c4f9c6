"""Dispatch: capacity, the sort-based row map of (token, expert) pairs, and the dispatchers that
move rows to the experts and back (one class per strategy, registered by name).

The uneven all-to-all lives in moe.comm; `moe.dispatch.all_to_all` is its one public path (the
one re-export here).
"""

from moe.comm.expert_exchange import all_to_all
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
from moe.dispatch.overlap_degree import choose_degree
from moe.dispatch.overlap_option import validate_overlap
from moe.dispatch.overlapped import OverlappedDispatcher
from moe.dispatch.permute import (
    DispatchPlan,
    RowMap,
    expert_choice_rows,
    gather_tokens,
    permute_rows,
    plan_expert_choice,
    plan_token_choice,
    sort_rows_by_expert,
    token_choice_rows,
    weighted_sum_rows,
)
from moe.dispatch.wire import RowFormat, RowWire, register_row_format, wire_for
