"""Portable, atomic, pickle-free checkpoints of model and optimizer state.

Layout of `path/`:
    LATEST                      the name of the current complete checkpoint (replaced atomically)
    ckpt-<id>/manifest.json     every tensor: key, file, offset, nbytes, dtype, shape, crc32
    ckpt-<id>/data-<rank>.bin   raw little-endian tensor bytes written by that rank
Expert tensors are stored one slice per global expert id ("model/<name>#expert=<e>", optimizer
state likewise), dense tensors once (by rank 0), so a run saved at one EP size loads at any
other. Nothing is unpickled: the manifest is JSON, the data raw bytes.

Atomicity: every rank writes into `path/.tmp-<id>/`; after all ranks have written and synced
their files, rank 0 writes the manifest, renames the directory to `ckpt-<id>` and only then
replaces LATEST. A save killed at any point leaves LATEST naming the previous checkpoint.

Loading validates every tensor it needs (present, shape, dtype, size, checksum) on every rank
before copying anything; any problem raises ValueError naming the tensor on all ranks.
"""

import json
import os
import shutil
import time
import uuid
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe.checkpoint.manifest import (
    FORMAT,
    VERSION,
    CheckpointError,
)
from moe.experts import GroupedExperts

LATEST = "LATEST"


@dataclass(frozen=True)
class _Item:
    """One stored tensor: model or optimizer, parameter/buffer name, state key, expert id."""

    kind: str  # "model" or "optim"
    name: str
    state: str | None = None
    expert: int | None = None

    @property
    def key(self) -> str:
        key = f"{self.kind}/{self.name}" + (f"/{self.state}" if self.state else "")
        return key if self.expert is None else f"{key}#expert={self.expert}"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _expert_modules(model: nn.Module) -> dict[str, GroupedExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}


def _expert_params(model: nn.Module) -> dict[str, tuple[GroupedExperts, str]]:
    """Qualified parameter name -> (its GroupedExperts, local attribute name)."""
    out = {}
    for mname, module in _expert_modules(model).items():
        for pname, _ in module.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = (module, pname)
    return out


def _optimizer_states(opt, model: nn.Module) -> dict[str, dict]:
    """Parameter name -> its optimizer state (GroupedApply's include "master")."""
    if opt is None:
        return {}
    managed = _optimizer_index(opt)
    out = {}
    for name, p in model.named_parameters():
        if id(p) not in managed:
            continue
        state = opt.state_of(p) if hasattr(opt, "state_of") else dict(opt.state.get(p, {}))
        if state:
            out[name] = state
    return out


def _optimizer_index(opt) -> dict[int, int]:
    """id(param) -> index as the optimizer's state dicts number it."""
    if hasattr(opt, "state_of"):
        return {id(p): opt.index_of(p) for p in opt.params}
    params = [p for g in opt.param_groups for p in g["params"]]
    return {id(p): i for i, p in enumerate(params)}


def _as_tensor(value) -> tuple[torch.Tensor, str | None]:
    if isinstance(value, torch.Tensor):
        return value, None
    if isinstance(value, bool | int | float):
        kind = type(value).__name__
        return torch.tensor(value, dtype=torch.float64 if kind == "float" else torch.int64), kind
    raise TypeError(f"cannot checkpoint optimizer state of type {type(value).__name__}")


def _items_to_save(model: nn.Module, opt) -> list[tuple[_Item, torch.Tensor, str | None]]:
    """Every tensor of model and optimizer, experts split by global id."""
    experts = _expert_params(model)
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if name in experts:
            off = experts[name][0].expert_offset
            out += [(_Item("model", name, None, off + i), t[i], None) for i in range(t.shape[0])]
        else:
            out.append((_Item("model", name), t, None))
    for name, state in _optimizer_states(opt, model).items():
        for key, value in state.items():
            t, python = _as_tensor(value)
            if name not in experts:
                out.append((_Item("optim", name, key), t, python))
                continue
            module, attr = experts[name]
            local = getattr(module, attr).shape[0]
            if t.dim() > 0 and t.shape[0] != local:
                raise ValueError(
                    f"optimizer state {name}/{key} of shape {tuple(t.shape)} cannot be split "
                    f"per expert (dim 0 should be {local})"
                )
            off = module.expert_offset
            for i in range(local):
                piece = t[i] if t.dim() > 0 else t
                out.append((_Item("optim", name, key, off + i), piece, python))
    return out


def _expert_layout(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.expert_offset, m.num_experts) for n, m in _expert_modules(model).items()}


def _writes_here(item: _Item, model: nn.Module, rank: int, layouts: list[dict]) -> bool:
    """Dense tensors: rank 0. Expert e: the lowest rank holding it (one of its dp replicas)."""
    if item.expert is None:
        return rank == 0
    module = item.name.rsplit(".", 1)[0] if "." in item.name else ""
    for r, layout in enumerate(layouts):
        offset, count = layout.get(module, (0, 0))
        if offset <= item.expert < offset + count:
            return r == rank
    return False


def _tensor_bytes(t: torch.Tensor):
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else memoryview(b"")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_data(file: str, items) -> dict[str, dict]:
    entries = {}
    offset = 0
    with open(file, "wb") as f:
        for item, t, python in items:
            data = _tensor_bytes(t)
            _write_tensor(f, data)
            nbytes = len(data) if isinstance(data, memoryview) else data.nbytes
            entries[item.key] = {
                "kind": item.kind,
                "name": item.name,
                "state": item.state,
                "expert": item.expert,
                "file": os.path.basename(file),
                "offset": offset,
                "nbytes": nbytes,
                "dtype": str(t.dtype),
                "shape": list(t.shape),
                "crc32": zlib.crc32(data),
                "python": python,
            }
            offset += nbytes
        f.flush()
        os.fsync(f.fileno())
    return entries


def _write_tensor(f, data) -> None:
    f.write(data)


def _jsonable(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list | tuple):
        items = [_jsonable(v) for v in value]
        return None if any(i is _SKIP for i in items) else items
    return _SKIP


_SKIP = object()
# Implementation switches belong to the optimizer being loaded into, not to the checkpoint.
_NOT_RESTORED = {"params", "foreach", "fused", "capturable", "differentiable"}


def _optimizer_meta(opt) -> dict | None:
    if opt is None:
        return None
    groups = []
    for g in opt.param_groups:
        hyper = {k: _jsonable(v) for k, v in g.items() if k not in _NOT_RESTORED}
        groups.append({k: v for k, v in hyper.items() if v is not _SKIP and v is not None})
    scaler = getattr(opt, "loss_scaler", None)
    return {
        "class": type(opt).__name__,
        "param_groups": groups,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
    }


def save_checkpoint(path: str, model: nn.Module, opt=None, *, extra: dict | None = None) -> str:
    """Save `model` (and optimizer `opt`: GroupedApply or any torch optimizer) under `path`.
    Collective: every rank calls it. `extra` is JSON metadata (e.g. the step). Returns the
    directory of the new checkpoint."""
    rank, world = _world()
    items = _items_to_save(model, opt)
    layouts = [_expert_layout(model)]
    ident = [f"{time.time_ns():x}-{uuid.uuid4().hex[:8]}"]
    if world > 1:
        layouts = [None] * world
        dist.all_gather_object(layouts, _expert_layout(model))
        dist.broadcast_object_list(ident, src=0)
    mine = [it for it in items if _writes_here(it[0], model, rank, layouts)]
    tmp = os.path.join(path, f".tmp-{ident[0]}")
    os.makedirs(tmp, exist_ok=True)
    entries = _write_data(os.path.join(tmp, f"data-{rank:05d}.bin"), mine)
    gathered = [entries]
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(entries, gathered, dst=0)
    final = os.path.join(path, f"ckpt-{ident[0]}")
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": world,
            "tensors": {k: v for part in gathered for k, v in part.items()},
            "optimizer": _optimizer_meta(opt),
            "extra": extra or {},
        }
        _commit(path, tmp, final, manifest)
    if world > 1:
        dist.barrier()
    return final


def _commit(path: str, tmp: str, final: str, manifest: dict) -> None:
    """Manifest, rename, then the LATEST pointer; finally remove older checkpoints."""
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    os.rename(tmp, final)
    pointer = os.path.join(path, LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(os.path.basename(final))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(path, LATEST))
    _fsync_dir(path)
    keep = os.path.basename(final)
    for name in os.listdir(path):
        if name != keep and (name.startswith("ckpt-") or name.startswith(".tmp-")):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def checkpoint_dir(path: str) -> str:
    """The directory of the current complete checkpoint under `path` (or `path` itself when
    it is a checkpoint directory)."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    pointer = os.path.join(path, LATEST)
    if not os.path.isfile(pointer):
        raise FileNotFoundError(f"no complete checkpoint under {path!r} (no {LATEST} file)")
    with open(pointer) as f:
        name = f.read().strip()
    if not name.startswith("ckpt-") or os.path.basename(name) != name:
        raise CheckpointError(f"{pointer} names {name!r}, not a checkpoint directory")
    directory = os.path.realpath(os.path.join(path, name))
    if os.path.dirname(directory) != os.path.realpath(path):
        raise CheckpointError(f"{pointer} names {name!r}, which resolves outside {path!r}")
    return directory
