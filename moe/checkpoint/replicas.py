"""Checkpoints of layers with expert replicas (MoEConfig.spare_slots) hold canonical experts.

Save: each replicated layer's expert weights and their optimizer state are written as E rows
in canonical expert order (each expert's first copy, slot_of_expert_E), its placement as the
identity and no slot map: the checkpoint is the one the same model without spare slots would
write, so it loads at any (dp, ep), with or without spare slots, and in one process.
Load into a layer with spare slots: the E canonical rows are read whole and every slot takes
its expert's row (the live slot map is kept). Cost: a replicated layer's experts are gathered
whole on every rank while saving and loading (not only this rank's slots).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moe.layer import MoELayer, moe_layers
from moe.shards import dtensor_like, local
from moe.slots.layout import with_copies


def replica_layers(model: nn.Module) -> dict[str, MoELayer]:
    """{state-dict prefix ("" or "name."): layer} of the layers with spare slots."""
    return {(f"{name}." if name else ""): layer for name, layer in with_copies(moe_layers(model))}


def _expert_fqn(key: str, layers: dict[str, MoELayer]) -> tuple[MoELayer, str] | None:
    """(layer, its prefix) when `key` ("model/<fqn>" or "optim/<fqn>/<state>") is an expert
    parameter or its state of a replicated layer."""
    fqn = key[len("model/") :] if key.startswith("model/") else key[len("optim/") :]
    if key.startswith("optim/"):
        fqn = fqn.rpartition("/")[0]
    for prefix, layer in layers.items():
        if fqn.startswith(prefix + "experts.") and "." not in fqn[len(prefix + "experts.") :]:
            return layer, prefix
    return None


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def to_canonical(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """In place on collect()'s tensors: replicated layers' expert rows in canonical order."""
    layers = replica_layers(model)
    for key in list(tensors):
        hit = _expert_fqn(key, layers)
        if hit is None or tensors[key].dim() == 0:
            continue
        full = _full(tensors[key])
        tensors[key] = full.index_select(0, hit[0].slot_of_expert_E.to(full.device))
    for prefix, layer in layers.items():
        tensors.pop(f"model/{prefix}expert_of_slot_S", None)
        E = layer.config.num_experts
        tensors[f"model/{prefix}slot_of_expert_E"] = torch.arange(
            E, device=layer.slot_of_expert_E.device
        )


def canonical_like(model: nn.Module, key: str, live: torch.Tensor) -> torch.Tensor | None:
    """The shape a stored tensor has for a live one: [E, ...] plain for a replicated layer's
    expert rows (None: this key is not stored, the slot map), else `live` itself."""
    layers = replica_layers(model)
    for prefix in layers:
        if key == f"model/{prefix}expert_of_slot_S":
            return None
    hit = _expert_fqn(key, layers)
    if hit is None or live.dim() == 0:
        return live
    E = hit[0].config.num_experts
    return torch.empty((E, *live.shape[1:]), dtype=live.dtype, device=local(live).device)


def to_slots(model: nn.Module, key: str, canonical: torch.Tensor, like: torch.Tensor):
    """A loaded canonical [E, ...] tensor in the live slot layout of `like` (a DTensor with
    its placements, or a plain tensor): slot s takes the row of expert expert_of_slot_S[s]."""
    hit = _expert_fqn(key, replica_layers(model))
    if hit is None or canonical.dim() == 0:
        return canonical
    slots_S = hit[0].expert_of_slot_S.to(canonical.device)
    full = canonical.index_select(0, slots_S)
    if not isinstance(like, DTensor):
        return full.to(like.dtype)
    shape, offset = compute_local_shape_and_global_offset(
        like.shape, like.device_mesh, like.placements
    )
    return dtensor_like(full[offset[0] : offset[0] + shape[0]].to(like.dtype).contiguous(), like)


def live_layout(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live slot maps of replicated layers, to keep through a load."""
    out = {}
    for prefix, layer in replica_layers(model).items():
        out[f"{prefix}slot_of_expert_E"] = layer.slot_of_expert_E.clone()
        out[f"{prefix}expert_of_slot_S"] = layer.expert_of_slot_S.clone()
    return out
