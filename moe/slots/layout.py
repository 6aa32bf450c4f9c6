"""The slot layout of every layer: S = E + R slots (MoEConfig.spare_slots = R), slot s holding
a copy of expert expert_of_slot[s]; every expert in at least one slot, copies of one expert on
different expert-parallel ranks; slot_of_expert[e] is expert e's first slot (the copy
checkpoints and exports read). A layout without copies (R = 0) is a permutation, and every
operation here is its identity case, so callers never branch on copies: this module, the
config and the replica guard are the only places that know whether a layer has them."""

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotLayout:
    """One layer's expert slots as a value: E canonical experts in S >= E slots (rows of the
    stacked expert weights), slot s holding a copy of expert expert_of_slot[s]. A layout
    without copies (S = E, MoEConfig.spare_slots = 0) is a permutation: rebalance_experts'
    placement. Host data: read it at step time (rebalance, sum, checkpoints, traces, HF
    export), never in a layer's forward; the layer keeps its device form (buffers)."""

    num_experts: int
    expert_of_slot: tuple[int, ...]

    @classmethod
    def of_config(cls, config) -> "SlotLayout":
        """The layout a new layer starts with (initial_expert_of_slot)."""
        return cls(config.num_experts, initial_expert_of_slot(config.num_experts, spare(config)))

    @classmethod
    def of_placement(cls, slot_of_expert) -> "SlotLayout":
        """A layout without copies from expert -> slot (a permutation)."""
        expert_of_slot = [0] * len(slot_of_expert)
        for e, s in enumerate(slot_of_expert):
            expert_of_slot[s] = e
        return cls(len(slot_of_expert), tuple(expert_of_slot))

    @property
    def num_slots(self) -> int:
        return len(self.expert_of_slot)

    @property
    def has_copies(self) -> bool:
        return self.num_slots > self.num_experts

    @property
    def copies(self) -> tuple[int, ...]:
        """Copies of each expert (all 1 without spare slots)."""
        return copies_of(self.expert_of_slot, self.num_experts)

    @property
    def slot_of_expert(self) -> tuple[int, ...]:
        """Each expert's first slot: the copy checkpoints and exports read."""
        return primary_slots(self.expert_of_slot, self.num_experts)

    def slots_per_rank(self, num_ranks: int) -> int:
        return self.num_slots // num_ranks

    def rank_of_expert(self, num_ranks: int) -> tuple[int, ...]:
        """The EP rank holding each expert's first copy (slots split evenly)."""
        per_rank = self.slots_per_rank(num_ranks)
        return tuple(s // per_rank for s in self.slot_of_expert)

    def check(self, num_ranks: int = 1) -> None:
        """Every expert in a slot, slots split evenly, copies on different ranks."""
        check_replica_placement(list(self.expert_of_slot), self.num_experts, num_ranks)

    def checksum(self) -> int:
        """A 56-bit digest of the layout (non-negative, fits int64): what the ranks of an
        expert-parallel group compare in each forward's count exchange (the layer keeps it
        beside the layout, moe.dispatch.replica_split.check_layouts_agree)."""
        data = ",".join(map(str, (self.num_experts, *self.expert_of_slot))).encode()
        return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")

    def fill_copies(self, t: torch.Tensor) -> None:
        """In place on a [S, ...] tensor: every spare slot's row from its expert's row (the
        first E slots hold the experts in order: a new layer). No-op without copies."""
        E = self.num_experts
        t[E:] = t[list(self.expert_of_slot[E:])]

    def for_canonical_load(self) -> "SlotLayout":
        """The layout to read canonical expert rows into (moe.load_hf_checkpoint): a layout
        without copies restarts as the identity placement (each rank reads its own contiguous
        experts); a replica layout is kept (every copy filled from its expert's row)."""
        return self if self.has_copies else SlotLayout.of_placement(range(self.num_experts))

    def experts_read(self, first: int, count: int) -> tuple[int, int]:
        """(first expert, number) of the contiguous canonical experts that slots
        [first, first + count) hold copies of: what a rank reads from a canonical file."""
        held = self.expert_of_slot[first : first + count]
        return min(held), max(held) - min(held) + 1


def with_copies(named_layers) -> list:
    """The (name, layer) pairs whose slots hold copies (S > E, fixed when the layer is built):
    the only layers with copies' gradients to sum (moe.parallel.replicas), canonical rows to
    gather for a checkpoint (moe.checkpoint.replicas) or a replica layout to store. For a
    layout without copies each of those is the identity, so it is left out here, once."""
    return [
        (name, layer)
        for name, layer in named_layers
        if num_slots(layer.config) > layer.config.num_experts
    ]


def state_entries(expert_of_slot_S: torch.Tensor, slot_of_expert_E: torch.Tensor) -> dict:
    """The layout keys of a layer's state dict, the ones every version wrote: slot_of_expert_E,
    and expert_of_slot_S when the layout holds copies (a permutation is its own inverse map)."""
    out = {"slot_of_expert_E": slot_of_expert_E}
    if expert_of_slot_S.numel() > slot_of_expert_E.numel():
        out["expert_of_slot_S"] = expert_of_slot_S
    return out


def spare(config) -> int:
    """R, the spare slots of a layer's config (the one reader outside moe/config.py)."""
    return config.spare_slots


def num_slots(config) -> int:
    """S = E + R: the expert slots of a layer built from `config` (the one place it is summed)."""
    return config.num_experts + spare(config)


def copies_of(expert_of_slot, num_experts: int) -> tuple[int, ...]:
    out = [0] * num_experts
    for e in expert_of_slot:
        out[e] += 1
    return tuple(out)


def primary_slots(expert_of_slot, num_experts: int) -> tuple[int, ...]:
    """Each expert's first slot: the copy checkpoints and exports read."""
    out = [-1] * num_experts
    for s, e in enumerate(expert_of_slot):
        if out[e] < 0:
            out[e] = s
    return tuple(out)


def check_replica_placement(expert_of_slot, num_experts: int, num_ranks: int) -> None:
    """Every expert in at least one slot, slots split evenly, copies on different ranks."""
    S = len(expert_of_slot)
    if num_ranks < 1 or S % num_ranks:
        raise ValueError(f"{S} slots cannot be split evenly over {num_ranks} ranks")
    if any(not 0 <= e < num_experts for e in expert_of_slot):
        raise ValueError(f"expert_of_slot holds ids outside 0..{num_experts - 1}")
    missing = [e for e, c in enumerate(copies_of(expert_of_slot, num_experts)) if c == 0]
    if missing:
        raise ValueError(f"expert_of_slot holds no copy of experts {missing[:16]}")
    L = S // num_ranks
    if num_ranks > 1:
        for r in range(num_ranks):
            held = expert_of_slot[r * L : (r + 1) * L]
            if len(set(held)) != len(held):
                raise ValueError(f"rank {r} holds two copies of one expert: {list(held)}")


def initial_expert_of_slot(num_experts: int, spare_slots: int) -> tuple[int, ...]:
    """Before any plan: experts in canonical order, then the spare slots copy experts
    0, 1, ... (one copy each while there are experts): exact from the first step, and on
    different ranks from the originals whenever E >= L (W > 1)."""
    return tuple(range(num_experts)) + tuple(i % num_experts for i in range(spare_slots))


def first_slots(expert_of_slot_S: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] each expert's first slot, on the device (no host read: forward-safe)."""
    S = expert_of_slot_S.numel()
    slot_S = torch.arange(S, dtype=torch.long, device=expert_of_slot_S.device)
    first_E = torch.full((num_experts,), S, dtype=torch.long, device=expert_of_slot_S.device)
    return first_E.scatter_reduce(0, expert_of_slot_S, slot_S, "amin")


def layout_from_state(name: str, state_dict: dict, prefix: str, config) -> "SlotLayout | None":
    """The slot layout a layer's state dict holds (`slot_of_expert_E`, and `expert_of_slot_S`
    with copies: the keys every version wrote), checked against the layer's config before
    anything is loaded; None when it holds none (a state dict saved before placements existed:
    canonical order; with copies: missing keys). Raises ValueError naming layer and key."""
    key, replicas = prefix + "slot_of_expert_E", prefix + "expert_of_slot_S"
    E = config.num_experts
    if spare(config):
        if key not in state_dict and replicas not in state_dict:
            return None
        check_replica_state(name, state_dict, prefix, config)
        return SlotLayout(E, tuple(int(v) for v in state_dict[replicas].tolist()))
    if replicas in state_dict:
        raise ValueError(
            f"{name}: {replicas} holds a replica layout of "
            f"{len(state_dict[replicas])} slots, but this layer has no spare slots "
            "(MoEConfig.spare_slots=0); load it through moe.checkpoint, which reads "
            "canonical experts, or build the layer with the same spare_slots"
        )
    if key not in state_dict:
        return SlotLayout.of_placement(range(E))
    slots = state_dict[key]
    if (
        not isinstance(slots, torch.Tensor)
        or slots.dtype != torch.long
        or tuple(slots.shape) != (E,)
        or not torch.equal(slots.sort().values.cpu(), torch.arange(E))
    ):
        raise ValueError(f"{name}: {key} is not a permutation of {E} expert ids")
    return SlotLayout.of_placement(slots.tolist())


def check_replica_state(name: str, state_dict: dict, prefix: str, config) -> None:
    """A state dict's replica layout must fit the layer: expert_of_slot_S [E + R] long with
    every expert, slot_of_expert_E its first slots. Raises ValueError naming layer and value."""
    E, S = config.num_experts, num_slots(config)
    eos, soe = (
        state_dict.get(prefix + "expert_of_slot_S"),
        state_dict.get(prefix + "slot_of_expert_E"),
    )
    for key, value, n in (("expert_of_slot_S", eos, S), ("slot_of_expert_E", soe, E)):
        if (
            not isinstance(value, torch.Tensor)
            or value.dtype != torch.long
            or tuple(value.shape) != (n,)
        ):
            shown = tuple(value.shape) if isinstance(value, torch.Tensor) else value
            raise ValueError(
                f"{name}: {prefix}{key} must be a long tensor of {n} entries "
                f"(num_experts={E}, spare_slots={S - E}), got {shown}"
            )
    slots = [int(v) for v in eos.tolist()]
    try:
        check_replica_placement(slots, E, 1)
    except ValueError as e:
        raise ValueError(f"{name}: {prefix}expert_of_slot_S: {e}") from None
    if [int(v) for v in soe.tolist()] != list(primary_slots(slots, E)):
        raise ValueError(
            f"{name}: {prefix}slot_of_expert_E is not each expert's first slot in expert_of_slot_S"
        )


def check_spare_slots(name: str, expert_of_slot, config, ep: int) -> None:
    """Spare slots over `ep` expert-parallel ranks: R a multiple of ep, at most E * (ep - 1)
    copies beyond the experts, and a layout with no two copies of an expert on one rank."""
    E, R = config.num_experts, spare(config)
    if R % ep:
        raise ValueError(f"{name}: spare_slots={R} is not a multiple of the EP size {ep}")
    if ep > 1 and E * (ep - 1) < R:
        raise ValueError(
            f"{name}: spare_slots={R} needs more copies of an expert than there are EP ranks "
            f"({E} experts x {ep} ranks)"
        )
    try:
        check_replica_placement(list(expert_of_slot), E, ep)
    except ValueError as e:
        raise ValueError(f"{name}: expert_of_slot_S at ep={ep}: {e}") from None
