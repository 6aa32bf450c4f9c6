"""Hugging Face safetensors checkpoints straight into / out of a from_hf-converted model.

load_hf_checkpoint reads the hub layout (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`; per-expert keys such as `...block_sparse_moe.experts.3.w1.weight`
or `...mlp.experts.3.gate_proj.weight`) and the fused layout (`...mlp.experts.gate_up_proj`
[E, 2F, d], `...mlp.experts.down_proj` [E, d, F]). Under expert parallelism each rank reads
only its own experts' tensors (fused ones by slice), so memory stays its shard plus one tensor.
Every key, shape and file of the whole model is checked on every rank, from the safetensors
headers, before any weight changes: missing or extra keys, shape mismatches and files outside
the directory are one HFCheckpointError naming them. No pickle; transformers is not needed.

save_hf_checkpoint (moe/interop/hf_save.py) writes what this reads; the two share the list of
the model's hub tensors (_pieces). A layer converted through transformers' experts contract
(HFExpertsLayer) is stored under its experts module's own names (`<path>.gate_up_proj`, ...,
read from the module it replaced): every rank reads that layer's whole tensors into a copy of
the module, converts it as from_hf does (hf_contract.convert: its layout, its quirks) and keeps
its own experts' rows.
"""

import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from moe.interop import hf_contract
from moe.interop.hf import HFMoELayer
from moe.interop.hf_contract import HFExpertsLayer
from moe.interop.hf_families import FAMILIES
from moe.interop.hf_files import (
    INDEX,
    SINGLE,
    HFCheckpointError,
    headers_of,
    inside,
    weight_map_of,
)

_SHARED = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Piece:
    """One hub tensor (or a slice of a fused one) and where it goes in the model."""

    name: str  # model state-dict name
    hub_key: str
    expert: int | None  # global expert id (per-expert keys) or None
    local: bool  # this rank holds it
    shape: tuple  # expected hub shape
    fused: str | None = None  # "gate", "up", "down" for fused expert tensors; "contract": one
    # tensor of a contract layer's experts module (name: the layer's path)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _layers(model: nn.Module) -> dict[str, HFMoELayer]:
    """The table's converted blocks (the contract's layers: _contract_pieces)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, HFMoELayer)}
    other = [n for n, m in model.named_modules() if isinstance(m, HFExpertsLayer)]
    if not layers and not other:
        raise HFCheckpointError("the model has no converted block: call moe.from_hf(model) first")
    return layers


def _layer_pieces(path: str, layer: HFMoELayer, fused: bool) -> list[Piece]:
    family = FAMILIES[layer.hf_block_class.__name__]
    hub, c = family.hub_path(path), layer.config
    E, d, F = c.num_experts, c.d_model, c.d_ff
    lo, count = _expert_range(layer)
    hi = lo + count
    pieces = [Piece(f"{path}.router.weight", f"{hub}.gate.weight", None, True, (E, d))]
    if c.score_func == "sigmoid":
        bias = f"{hub}.gate.e_score_correction_bias"
        pieces.append(Piece(f"{path}.router.expert_bias", bias, None, True, (E,)))
    names = dict(zip(("w1", "w3", "w2"), family.hub_experts))
    if fused:
        for param, part in (("w1", "gate"), ("w3", "up")):
            key = f"{path}.experts.gate_up_proj"
            pieces.append(Piece(f"{path}.experts.{param}", key, None, True, (E, 2 * F, d), part))
        key = f"{path}.experts.down_proj"
        pieces.append(Piece(f"{path}.experts.w2", key, None, True, (E, d, F), "down"))
    else:
        for param, hub_name in names.items():  # parameter-major: one block completes at a time
            for j in range(E):
                shape = (d, F) if param == "w2" else (F, d)
                key = f"{hub}.experts.{j}.{hub_name}.weight"
                pieces.append(Piece(f"{path}.experts.{param}", key, j, lo <= j < hi, shape))
    if layer.shared_experts is not None:
        Fs = layer.shared_experts.up_proj.out_features
        for proj in _SHARED:
            shape = (d, Fs) if proj == "down_proj" else (Fs, d)
            key = f"{hub}.{family.shared_name}.{proj}.weight"
            pieces.append(Piece(f"{path}.shared_experts.{proj}.weight", key, None, True, shape))
        if layer.shared_experts.gate is not None:
            key = f"{hub}.shared_expert_gate.weight"
            pieces.append(Piece(f"{path}.shared_experts.gate.weight", key, None, True, (1, d)))
    return pieces


def _expert_range(layer: HFMoELayer) -> tuple[int, int]:
    """(first, count) of the canonical experts this rank reads: those its slots hold in the
    layout the load adopts (SlotLayout.for_canonical_load: its own contiguous experts for a
    placement, the experts its copies hold with replicas)."""
    layout = layer.slot_layout().for_canonical_load()
    return layout.experts_read(layer.experts.expert_offset, layer.experts.num_experts)


def _in_slots(layer: HFMoELayer, rows: torch.Tensor, first: int) -> torch.Tensor:
    """The rows read for `_expert_range` (canonical experts from `first`) in this rank's
    slots, each slot taking its expert's row (copies filled)."""
    lo, L = layer.experts.expert_offset, layer.experts.num_experts
    return rows[layer.expert_of_slot_S[lo : lo + L].to(rows.device) - first]


def _pieces(model: nn.Module, fused: bool) -> list[Piece]:
    """Every hub tensor of the whole model (all experts, also those other ranks hold)."""
    layers = _layers(model)
    pieces = [p for path, layer in layers.items() for p in _layer_pieces(path, layer, fused)]
    for path, m in model.named_modules():  # the experts module's own tensors, as it names them
        if isinstance(m, HFExpertsLayer):
            for n, t in m.hf_template[0].state_dict().items():
                pieces.append(Piece(path, f"{path}.{n}", None, True, tuple(t.shape), "contract"))
    converted = (HFMoELayer, HFExpertsLayer)  # inside: e.g. a softmax router's unused bias
    inside = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, converted))
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if name.startswith(inside) or id(t) in seen:  # tied weights are stored once
            continue
        seen.add(id(t))
        pieces.append(Piece(name, name, None, True, tuple(t.shape)))
    return pieces


def _check(
    pieces: list[Piece], weight_map: dict, headers: dict, stored_in: dict, directory: str
) -> None:
    problems = []
    wanted = {p.hub_key for p in pieces}
    for p in pieces:
        if p.hub_key not in weight_map or p.hub_key not in headers:
            problems.append(f"missing key {p.hub_key} (for {p.name})")
        elif weight_map[p.hub_key] != stored_in[p.hub_key]:
            problems.append(
                f"{p.hub_key}: the index names {os.path.basename(weight_map[p.hub_key])!r}, "
                f"but it is stored in {os.path.basename(stored_in[p.hub_key])!r}"
            )
        elif headers[p.hub_key][0] != p.shape:
            problems.append(
                f"{p.hub_key}: checkpoint shape {headers[p.hub_key][0]}, model expects {p.shape}"
            )
        elif headers[p.hub_key][1] not in ("F64", "F32", "F16", "BF16"):
            problems.append(f"{p.hub_key}: dtype {headers[p.hub_key][1]} is not floating point")
    problems += [f"unexpected key {k}" for k in sorted(set(weight_map) - wanted)]
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise HFCheckpointError(
            f"{directory} does not fit the model (nothing was loaded):\n  {shown}{more}"
        )


def _read(f, p: Piece, offset: int, count: int) -> torch.Tensor:
    """The piece's data for this rank, laid out as the model stores it."""
    if p.fused is None:
        t = f.get_tensor(p.hub_key)
        return t.t() if p.expert is not None else t
    rows = f.get_slice(p.hub_key)[offset : offset + count]  # only this rank's experts
    F = p.shape[1] // 2 if p.fused != "down" else p.shape[2]
    if p.fused == "gate":
        rows = rows[:, :F]
    elif p.fused == "up":
        rows = rows[:, F:]
    return rows.transpose(1, 2)


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str) -> nn.Module:
    """Load a hub-format (or fused) safetensors checkpoint into a from_hf-converted model,
    expert-parallel or not. Checks everything first; returns the model."""
    from safetensors import safe_open

    weight_map = weight_map_of(path)
    if weight_map is None:
        single = inside(path, SINGLE)
        if not os.path.lexists(single):
            raise HFCheckpointError(f"{path}: neither {INDEX} nor {SINGLE} found")
        headers, stored_in = headers_of({single}, path)
        weight_map = dict(stored_in)
    else:
        headers, stored_in = headers_of(set(weight_map.values()), path)
    fused = any(k.endswith(".experts.gate_up_proj") for k in weight_map)
    pieces = _pieces(model, fused)
    _check(pieces, weight_map, headers, stored_in, path)
    state = model.state_dict(keep_vars=True)
    owners = {n: m for n, m in model.named_modules() if isinstance(m, (HFMoELayer, HFExpertsLayer))}
    contract: dict[str, torch.Tensor] = {}  # the contract layer being read: its module's tensors
    for layer in owners.values():  # canonical rows: a placement restarts as the identity
        layer.set_slot_layout(layer.slot_layout().for_canonical_load())
    ranges = {name: _expert_range(layer) for name, layer in owners.items()}  # one host read
    rows: list[torch.Tensor] = []  # this rank's experts of the parameter being assembled
    for p in pieces:
        if not p.local:
            continue
        file = weight_map[p.hub_key]
        try:
            with safe_open(file, "pt") as f:
                if p.fused == "contract":
                    contract[p.hub_key.removeprefix(f"{p.name}.")] = f.get_tensor(p.hub_key)
                    template = owners[p.name].hf_template[0]
                    if len(contract) == len(template.state_dict()):
                        _load_contract(p.name, owners[p.name], contract, state, ranges[p.name])
                        contract = {}
                    continue
                if p.expert is None and p.fused is None:
                    _place(state[p.name], f.get_tensor(p.hub_key), p.name)
                    continue
                owner = p.name.rsplit(".experts.", 1)[0]
                layer, (first, count) = owners[owner], ranges[owner]
                value = _read(f, p, first, count)
        except HFCheckpointError:
            raise
        except Exception as e:  # safetensors' own error types; the file changed under us
            raise HFCheckpointError(f"safetensors file {file!r}: {p.hub_key}: {e}") from e
        if p.fused is not None:
            _place(state[p.name], _in_slots(layer, value, first), p.name)
            continue
        rows.append(value)
        if p.expert == first + count - 1:
            _place(state[p.name], _in_slots(layer, torch.stack(rows), first), p.name)
            rows = []
    return model


def _load_contract(path: str, layer: HFExpertsLayer, tensors: dict, state: dict, span) -> None:
    """A contract layer from its experts module's tensors (whole): a copy of the module holding
    them, converted as from_hf converts it (canonical expert order, no spare slots); this
    rank's experts of each stack and every other tensor (a post-expert norm) placed."""
    module = copy.deepcopy(layer.hf_template[0]).to_empty(device="cpu")
    module.load_state_dict(tensors)
    holder = nn.Module()
    holder.experts = module
    fresh = hf_contract.convert(holder, "experts", module)
    first, count = span
    for name, value in fresh.named_parameters():
        if name.startswith("experts."):  # [E, ...] in canonical order
            value = _in_slots(layer, value[first : first + count], first)
        _place(state[f"{path}.{name}"], value.detach(), f"{path}.{name}")


def _place(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy `value` (the whole tensor, or for experts this rank's [L, ...] block) into a plain
    tensor or into this rank's part of a DTensor (FSDP2 shards dim 0 in torch.chunk pieces)."""
    if not isinstance(target, DTensor):
        target.copy_(value)
        return
    local = target.to_local()
    if local.shape != value.shape:
        dim = next(i for i, pl in enumerate(target.placements) if pl.is_shard())
        chunks = torch.chunk(value, target.device_mesh.size(dim), dim=0)
        index = target.device_mesh.get_local_rank(dim)
        value = chunks[index] if index < len(chunks) else value[:0]
    if local.shape != value.shape:
        raise HFCheckpointError(f"{name}: cannot place {tuple(value.shape)} into {target}")
    local.copy_(value)


def _gathered(t: torch.Tensor, expert: bool) -> torch.Tensor:
    """Collective for DTensors: dense -> the full tensor; experts -> this rank's [L, ...]."""
    if not isinstance(t, DTensor):
        return t
    if not expert:
        return t.full_tensor()
    placements = [
        Replicate() if i < len(t.placements) - 1 else pl for i, pl in enumerate(t.placements)
    ]
    return t.redistribute(t.device_mesh, placements).to_local()
