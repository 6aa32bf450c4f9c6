"""Hugging Face safetensors checkpoints straight into / out of a from_hf-converted model.

load_hf_checkpoint reads the hub layout (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`; per-expert keys such as `...block_sparse_moe.experts.3.w1.weight`
or `...mlp.experts.3.gate_proj.weight`) and the fused layout (`...mlp.experts.gate_up_proj`
[E, 2F, d], `...mlp.experts.down_proj` [E, d, F]). Under expert parallelism each rank reads
only its own experts' tensors (fused ones by slice), so memory stays its shard plus one tensor.
Every key, shape and file of the whole model is checked on every rank, from the safetensors
headers, before any weight changes: missing or extra keys, shape mismatches and files outside
the directory are one HFCheckpointError naming them. No pickle; transformers is not needed.

save_hf_checkpoint writes the hub layout that transformers' from_pretrained loads (config.json,
per-rank shards, index), each rank writing its experts, into a staging directory published by
one rename.
"""

import json
import os
import shutil
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from moe.comm.consistency import all_gather_records
from moe.interop.hf import HFMoELayer
from moe.interop.hf_families import FAMILIES

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
_SHARED = ("gate_proj", "up_proj", "down_proj")


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that does not fit the model (nothing was changed)."""


@dataclass(frozen=True)
class Piece:
    """One hub tensor (or a slice of a fused one) and where it goes in the model."""

    name: str  # model state-dict name
    hub_key: str
    expert: int | None  # global expert id (per-expert keys) or None
    local: bool  # this rank holds it
    shape: tuple  # expected hub shape
    fused: str | None = None  # "gate", "up", "down" for fused expert tensors


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _layers(model: nn.Module) -> dict[str, HFMoELayer]:
    layers = {n: m for n, m in model.named_modules() if isinstance(m, HFMoELayer)}
    if not layers:
        raise HFCheckpointError("the model has no converted block: call moe.from_hf(model) first")
    return layers


def _layer_pieces(path: str, layer: HFMoELayer, fused: bool) -> list[Piece]:
    family = FAMILIES[layer.hf_block_class.__name__]
    hub, c = family.hub_path(path), layer.config
    E, d, F = c.num_experts, c.d_model, c.d_ff
    lo, hi = layer.experts.expert_offset, layer.experts.expert_offset + layer.experts.num_experts
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


def _pieces(model: nn.Module, fused: bool) -> list[Piece]:
    """Every hub tensor of the whole model (all experts, also those other ranks hold)."""
    layers = _layers(model)
    pieces = [p for path, layer in layers.items() for p in _layer_pieces(path, layer, fused)]
    inside = tuple(f"{path}." for path in layers)  # e.g. a softmax router's unused bias
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if name.startswith(inside) or id(t) in seen:  # tied weights are stored once
            continue
        seen.add(id(t))
        pieces.append(Piece(name, name, None, True, tuple(t.shape)))
    return pieces


def _inside(directory: str, name: str) -> str:
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.basename(name) != name or os.path.dirname(path) != root:
        raise HFCheckpointError(f"{directory}: file {name!r} is not a plain file in the directory")
    return path


def _weight_map(directory: str) -> dict[str, str]:
    """hub key -> file path, from the index or the single file's header."""
    from safetensors import safe_open

    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise HFCheckpointError(f"{index} is unreadable: {e}") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise HFCheckpointError(f"{index}: 'weight_map' must map keys to file names")
        return {k: _inside(directory, v) for k, v in weight_map.items()}
    single = _inside(directory, SINGLE)
    if not os.path.isfile(single):
        raise HFCheckpointError(f"{directory}: neither {INDEX} nor {SINGLE} found")
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def _headers(files: set[str]) -> dict[str, tuple[tuple, str]]:
    """hub key -> (shape, dtype) from the safetensors headers (no tensor data read)."""
    from safetensors import safe_open

    out = {}
    for file in sorted(files):
        try:
            with safe_open(file, "pt") as f:
                for key in f.keys():  # noqa: SIM118
                    s = f.get_slice(key)
                    out[key] = (tuple(s.get_shape()), s.get_dtype())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise HFCheckpointError(f"{file}: not a readable safetensors file: {e}") from e
    return out


def _check(pieces: list[Piece], weight_map: dict, headers: dict, directory: str) -> None:
    problems = []
    wanted = {p.hub_key for p in pieces}
    for p in pieces:
        if p.hub_key not in weight_map or p.hub_key not in headers:
            problems.append(f"missing key {p.hub_key} (for {p.name})")
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

    weight_map = _weight_map(path)
    fused = any(k.endswith(".experts.gate_up_proj") for k in weight_map)
    pieces = _pieces(model, fused)
    _check(pieces, weight_map, _headers(set(weight_map.values())), path)
    state = model.state_dict(keep_vars=True)
    owners = {n: m for n, m in model.named_modules() if isinstance(m, HFMoELayer)}
    for layer in owners.values():  # every expert is read in canonical order
        layer.slot_of_expert_E.copy_(torch.arange(layer.config.num_experts))
    rows: list[torch.Tensor] = []  # this rank's experts of the parameter being assembled
    for p in pieces:
        if not p.local:
            continue
        with safe_open(weight_map[p.hub_key], "pt") as f:
            if p.expert is None and p.fused is None:
                _place(state[p.name], f.get_tensor(p.hub_key), p.name)
                continue
            experts = owners[p.name.rsplit(".experts.", 1)[0]].experts
            value = _read(f, p, experts.expert_offset, experts.num_experts)
        if p.fused is not None:
            _place(state[p.name], value, p.name)
            continue
        rows.append(value)
        if p.expert == experts.expert_offset + experts.num_experts - 1:
            _place(state[p.name], torch.stack(rows), p.name)
            rows = []
    return model


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


def _holders(model: nn.Module) -> bool:
    """Whether this rank writes its experts: the lowest rank holding each expert range."""
    rank, world = _world()
    layout = {
        n: m.experts.expert_offset for n, m in model.named_modules() if isinstance(m, HFMoELayer)
    }
    if world == 1:
        return True
    records = all_gather_records({"layout": json.dumps(layout, sort_keys=True)})
    return all(r["layout"] != records[rank]["layout"] for r in records[:rank])


@torch.no_grad()
def save_hf_checkpoint(model: nn.Module, path: str) -> str:
    """Write the model in the hub layout transformers loads (collective under EP)."""
    from safetensors.torch import save_file

    rank, world = _world()
    writes_experts = _holders(model)
    state = model.state_dict(keep_vars=True)
    tensors, blocks = {}, {}
    slots = {m.name: m.slot_of_expert_E.tolist() for m in _layers(model).values()}
    for p in _pieces(model, fused=False):  # every rank in the same order: gathers are collective
        if p.expert is not None:
            if p.name not in blocks:
                blocks[p.name] = _gathered(state[p.name], expert=True)
            layer = model.get_submodule(p.name.rsplit(".experts.", 1)[0])
            first, slot = layer.experts.expert_offset, slots[layer.name][p.expert]
            if first <= slot < first + layer.experts.num_experts and writes_experts:
                tensors[p.hub_key] = blocks[p.name][slot - first].t()  # canonical expert ids
            continue
        value = _gathered(state[p.name], expert=False)
        if rank == 0:
            tensors[p.hub_key] = value
    ident = all_gather_records({"id": uuid.uuid4().hex[:12]})[0]["id"] if world > 1 else None
    staging = f"{path.rstrip(os.sep)}.partial-{ident or uuid.uuid4().hex[:12]}"
    os.makedirs(staging, exist_ok=True)
    file = f"model-{rank + 1:05d}-of-{world:05d}.safetensors"
    if tensors:
        cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
        save_file(cpu, os.path.join(staging, file), metadata={"format": "pt"})
    keys = {k: file for k in tensors}
    everyone = all_gather_records(keys) if world > 1 else [keys]
    if rank == 0:
        weight_map = {k: v for r in everyone for k, v in r.items()}
        with open(os.path.join(staging, INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f)
        model.config.to_json_file(os.path.join(staging, "config.json"))
        old = f"{path.rstrip(os.sep)}.old-{uuid.uuid4().hex[:12]}"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()
    return path
