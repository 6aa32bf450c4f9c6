"""rebalance_experts: move experts between expert-parallel ranks by their measured load.

Under expert parallelism rank r holds the experts in slots [r*L, (r+1)*L), and the most loaded
rank's all-to-all volume and GEMMs set every rank's step time. After an optimizer step,

    report = moe.parallel.rebalance_experts(model, optimizer)

sums each layer's per-expert load since the previous call over all ranks (one all-reduce),
plans a placement minimising the largest rank load (moe.slots.placement: LPT with L experts
per rank, pairwise swaps, kept when the gain is below `min_gain`) and applies it exactly.

Why a placement map and not a permutation of expert ids: every MoELayer keeps its router in
canonical expert ids and holds `slot_of_expert_E` (a persistent buffer): expert e's weights sit
in slot slot_of_expert_E[e] of the stacked expert tensors, and only the dispatch plan is built
in slots. So router weight rows, the score-correction bias, expert groups of group-limited
top-k, balance losses, stats and accumulated loads never move and keep their exact function;
only the moving experts' weight rows, their optimizer state (AdamW exp_avg / exp_avg_sq, fp32
masters: every state tensor shaped like the parameter; scalar `step` is shared by all experts)
and any pending gradient rows travel, in one all-to-all of bytes, straight from the rank that
holds a row to the rank that will (under FSDP2's "fsdp" each (dp, ep) rank holds a slice of
its experts and sends only that; under "ddp" each dp replica exchanges within its own EP
group). No rank ever gathers all experts. The model then computes the same function and
training continues as it would have (float32 reduction-order differences at most).

Checkpoints carry the placement (the buffer is in the state dict), so a save after a rebalance
reloads exactly at any (dp, ep) or in one process; moe.to_hf exports canonical expert order.

Every layer is planned from its slot layout (moe.slots.replica_placement.choose_layout): a layout
without copies as a placement, one with spare slots (moe.parallel.replicas) also deciding which
experts the spare slots copy; each slot whose expert changes is filled from a slot holding that
expert now, in the same exchange.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moe.comm.consistency import all_gather_records, describe_mismatch
from moe.layer import MoELayer, moe_layers
from moe.memory.grouped_apply import GroupedApply
from moe.parallel.mesh import layers_group
from moe.shards import local
from moe.slots import guard as replica_guard
from moe.slots.placement import Placement
from moe.slots.replica_placement import ReplicaPlacement, choose_layout


@dataclass
class RebalanceReport:
    """What one call did: each layer's placement decision (keyed by module name) and what this
    rank sent: expert rows (one row = one expert's slice of one tensor) and bytes."""

    layers: dict[str, Placement | ReplicaPlacement] = field(default_factory=dict)
    rows_sent: int = 0
    bytes_sent: int = 0

    @property
    def moved_experts(self) -> int:
        return sum(len(p.moved) for p in self.layers.values())


def ep_size(layer: MoELayer) -> int:
    """Expert-parallel ranks the layer's experts are spread over (1 in one process)."""
    return layer.num_slots // layer.experts.num_experts


def _optimizer_states(optimizer, p: torch.Tensor) -> list[torch.Tensor]:
    """The optimizer's per-element state tensors of `p` (shaped like it), in key order."""
    if optimizer is None:
        return []
    if isinstance(optimizer, GroupedApply):
        state = optimizer.state_of(p)
    else:
        state = optimizer.state.get(p, {})
    shape = local(p).shape
    return [
        state[k]
        for k in sorted(state)
        if isinstance(state[k], torch.Tensor) and local(state[k]).shape == shape
    ]


def _moving_tensors(layer: MoELayer, optimizer) -> list[torch.Tensor]:
    """Local views of everything indexed by slot: parameters, optimizer state, gradients."""
    out = []
    for _, p in layer.experts.named_parameters(recurse=False):
        out.append(local(p))
        out += [local(s) for s in _optimizer_states(optimizer, p)]
        if p.grad is not None:
            out.append(local(p.grad))
    return out


def _slot_range(layer: MoELayer) -> tuple[int, int]:
    """(first slot, number of slots) held by this rank (a slice of its EP block under fsdp)."""
    w1 = layer.experts.w1
    if not isinstance(w1, DTensor):
        raise ValueError(
            f"{layer.name}: experts are split over ranks but not DTensors; "
            "use moe.parallel.parallelize"
        )
    shape, offset = compute_local_shape_and_global_offset(w1.shape, w1.device_mesh, w1.placements)
    return offset[0], shape[0]


def _transfers(old, new, ranges):
    """[(src rank, dst rank, src row, dst row)] in one order every rank agrees on, from the
    expert_of_slot lists `old` to `new`: each slot whose expert changes is filled, on every
    rank holding it, from the first slot holding that expert now (the holder at the same
    position: under "ddp" the same dp replica)."""
    holders = [[q for q, (lo, n) in enumerate(ranges) if lo <= s < lo + n] for s in range(len(old))]
    first = {}
    for s, e in enumerate(old):
        first.setdefault(e, s)
    out = []
    for s in range(len(new)):
        if new[s] == old[s]:
            continue
        src = first[new[s]]
        for i, q in enumerate(holders[s]):
            h = holders[src][i % len(holders[src])]
            out.append((h, q, src - ranges[h][0], s - ranges[q][0]))
    return out


def _layout(layer: MoELayer) -> torch.Tensor:
    """The placement every rank must agree on: slot_of_expert_E and expert_of_slot_S."""
    return torch.cat([layer.slot_of_expert_E, layer.expert_of_slot_S])


def _row_bytes(t: torch.Tensor, row: int) -> torch.Tensor:
    r = t[row]
    if not r.is_contiguous():
        raise ValueError("expert tensors must have contiguous rows")
    return r.reshape(-1).view(torch.uint8)


def _exchange(jobs, device, group=None) -> tuple[int, int]:
    """jobs: [(tensors, transfers)] per layer, ranks numbered in `group`. One
    all_to_all_single of the moving rows as bytes over `group` (the model's mesh); received
    rows are written in place afterwards."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    send = [[] for _ in range(world)]
    recv_plan = [[] for _ in range(world)]  # (tensor, row) in the order the peer packs them
    for tensors, transfers in jobs:
        for src, dst, src_row, dst_row in transfers:
            for t in tensors:
                if src == me:
                    send[dst].append(_row_bytes(t, src_row))
                if dst == me:
                    recv_plan[src].append((t, dst_row))
    send_sizes = [sum(b.numel() for b in bs) for bs in send]
    recv_sizes = [sum(_row_bytes(t, r).numel() for t, r in plan) for plan in recv_plan]
    rows = [b.to(device) for bs in send for b in bs]
    send_buf = torch.cat(rows) if rows else torch.empty(0, dtype=torch.uint8, device=device)
    recv_buf = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv_buf, send_buf, recv_sizes, send_sizes, group=group)
    offset = 0
    for plan in recv_plan:
        for t, row in plan:
            dest = _row_bytes(t, row)
            dest.copy_(recv_buf[offset : offset + dest.numel()])
            offset += dest.numel()
    return sum(len(bs) for bs in send), send_buf.numel()


def _restart_counts(layers) -> None:
    for _, layer in layers:
        layer.balance.load_since_rebalance = None


def _holds(optimizer, p: torch.Tensor) -> bool:
    """Whether `optimizer` (a torch optimizer or GroupedApply) updates parameter `p`."""
    if isinstance(optimizer, GroupedApply):
        try:
            optimizer.index_of(p)
        except KeyError:
            return False
        return True
    return any(q is p for g in getattr(optimizer, "param_groups", []) for q in g["params"])


def _local_problem(layers, optimizer, min_gain) -> str | None:
    """What this rank finds wrong before anything moves (None when nothing): checked on every
    rank, then agreed, so every rank raises the same error or none does."""
    if not (isinstance(min_gain, (int, float)) and 0.0 <= min_gain < 1.0):
        return f"min_gain must be in [0, 1), got {min_gain!r}"
    if optimizer is not None and not (
        hasattr(optimizer, "state") or isinstance(optimizer, GroupedApply)
    ):
        return f"optimizer {type(optimizer).__name__} exposes no per-parameter state"
    for name, layer in layers:
        if layer.backward_pending():
            return (
                f"{name}: a training forward is waiting for its backward; call "
                "rebalance_experts after optimizer.step(), not between forward and backward"
            )
        if layer.replica_grads_pending:  # copies hold partial gradients: moving them
            return (  # copies one copy's share (issue 41 item 1)
                f"{name}: the expert copies hold unsummed gradients; call "
                "moe.parallel.sum_replica_grads after the last backward of the step, then "
                "rebalance_experts (after optimizer.step(); never between micro-batches)"
            )
        if optimizer is None:
            continue
        if isinstance(layer.experts, FSDPModule):  # FSDP2 may hold gathered weights after a
            layer.experts.reshard()  # no-grad forward: its registered parameters are the shards
        for pname, p in layer.experts.named_parameters(recurse=False):
            if not _holds(optimizer, p):
                return (
                    f"{name}: the optimizer does not hold expert parameter {pname}; pass the "
                    "optimizer that trains the model (its state moves with the weights)"
                )
    return None


def _agree(problem: str | None, min_gain: float, group=None) -> None:
    """One exchange of every rank's verdict and min_gain (moe.comm.consistency records) over
    `group`: the same ValueError on every rank, at once, when any rank found a problem or they
    differ."""
    gain = min_gain if isinstance(min_gain, (int, float)) else repr(min_gain)
    records = all_gather_records({"problem": problem, "min_gain": gain}, group)
    for rank, record in enumerate(records):
        if record.get("problem") is not None:
            raise ValueError(f"rebalance_experts: rank {rank}: {record['problem']}")
    message = describe_mismatch(records)
    if message is not None:
        raise ValueError(f"rebalance_experts: {message}")


@torch.no_grad()
def rebalance_experts(
    model: nn.Module, optimizer=None, *, min_gain: float = 0.05
) -> RebalanceReport:
    """Re-place every MoE layer's experts on its expert-parallel ranks by the load (rows its
    experts computed in training forwards) since the previous call, and reset that count.

    Collective over all ranks of the model's mesh (its layers' mesh, e.g. one pipeline
    stage's ranks: moe.parallel.mesh.layers_group); call it on each of them, after
    optimizer.step() (outside forward / backward), with the optimizer whose state must move
    along (a torch optimizer or GroupedApply holding every expert parameter; None moves
    weights and gradients only). A layer's placement changes only when its largest rank load
    drops by at least `min_gain` (relative). In one process, or with ep = 1, it only resets
    the counts (no-op). A bad argument, an optimizer without the expert parameters, a call
    between forward and backward, ranks passing different `min_gain` or holding different
    placements: the same ValueError on every rank, before anything moves."""
    layers = moe_layers(model)
    problem = _local_problem(layers, optimizer, min_gain)
    sizes = [ep_size(layer) for _, layer in layers]
    if not layers or max(sizes) == 1:  # every expert on every rank: nothing to place
        if problem is not None:
            raise ValueError(f"rebalance_experts: {problem}")
        _restart_counts(layers)
        return RebalanceReport()
    if not dist.is_initialized():
        raise ValueError("experts are split over ranks but torch.distributed is not initialized")
    group = layers_group(layers)
    _agree(problem, min_gain, group)
    report = RebalanceReport()
    ranges = [_slot_range(layer) for (_, layer), w in zip(layers, sizes) if w > 1]
    loads = _summed_loads(layers, group)
    _restart_counts(layers)
    plans = _choose_layouts(layers, sizes, loads, min_gain)
    report.layers.update((name, plan) for (name, _), plan in zip(layers, plans))
    changed = [i for i, p in enumerate(plans) if p.changed]
    if not changed:  # every rank computed the same plans: no rank exchanges
        return report
    # Where each rank's rows sit (a rank's slice of its EP block under fsdp): one all_gather.
    device = layers[0][1].slot_of_expert_E.device
    multi = [i for i, w in enumerate(sizes) if w > 1]
    mine = torch.tensor([v for r in ranges for v in r], dtype=torch.long, device=device)
    size = dist.get_world_size(group)
    everyone = mine.new_empty(size * mine.numel())
    # torch >= 2.13 deprecates all_gather_into_tensor for all_gather_single (absent in 2.11)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(everyone, mine, group=group)
    table = everyone.view(size, -1).tolist()
    jobs = []
    for i in changed:
        _, layer = layers[i]
        if isinstance(layer.experts, FSDPModule):  # FSDP2 may keep gathered weights from a forward
            layer.experts.reshard()  # without backward: drop them so the next one re-gathers
        k = multi.index(i)
        rank_ranges = [(row[2 * k], row[2 * k + 1]) for row in table]
        transfers = _layer_transfers(layer, plans[i], rank_ranges)
        jobs.append((_moving_tensors(layer, optimizer), transfers))
    report.rows_sent, report.bytes_sent = _exchange(jobs, device, group)
    for i in changed:
        layer = layers[i][1]
        layer.set_slot_layout(plans[i].layout(layer.config.num_experts))
        replica_guard.still_summed([layer])  # summed gradient rows moved with their slots
    return report


def _summed_loads(layers, group=None) -> list[int]:
    """The one collective every call makes: every layer's loads summed over the ranks, and
    each layer's placement s summed with s^2, which equal (world * s, world * s^2) only if
    every rank holds the same s (the same verdict on every rank)."""
    counts = []
    for _, layer in layers:
        load_E = layer.balance.load_since_rebalance
        slots = layer.slot_of_expert_E
        counts.append(torch.zeros_like(slots) if load_E is None else load_E.to(slots))
    slots = torch.cat([_layout(layer) for _, layer in layers])
    load = torch.cat([torch.cat(counts), slots, slots * slots])
    dist.all_reduce(load, group=group)
    n, world, nc = slots.numel(), dist.get_world_size(group), sum(c.numel() for c in counts)
    summed, squares = load[nc : nc + n], load[nc + n :]
    if not torch.equal(summed * summed, world * squares):  # the same verdict on every rank
        raise ValueError("ranks hold different expert placements (slot_of_expert_E)")
    return load[:nc].tolist()


def _choose_layouts(layers, sizes, loads: list[int], min_gain: float) -> list:
    """Each layer's new layout from its summed loads (every rank computes the same)."""
    plans, start = [], 0
    for (_, layer), w in zip(layers, sizes):
        E = layer.config.num_experts
        plans.append(choose_layout(loads[start : start + E], layer.slot_layout(), w, min_gain))
        start += E
    return plans


def _layer_transfers(layer: MoELayer, plan, rank_ranges):
    """The row moves from the layer's slot layout to `plan`'s, slot by slot."""
    old = layer.slot_layout().expert_of_slot
    return _transfers(old, plan.layout(layer.config.num_experts).expert_of_slot, rank_ranges)
