"""Loading a checkpoint written by moe.checkpoint.native.save_checkpoint, at any EP size.

The manifest and every tensor are validated (schema, paths, sizes, checksums, shapes and
dtypes against the model, optimizer state against its parameters) on every rank before
anything is copied; any problem raises CheckpointError naming the tensor on all ranks.
"""

from dataclasses import dataclass

import torch
from torch import nn

from moe.checkpoint.manifest import CheckpointError, load_manifest, read_tensor
from moe.checkpoint.native import (
    _expert_params,
    _Item,
    _optimizer_index,
    _world,
    checkpoint_dir,
)
from moe.comm.consistency import all_gather_records


def read_manifest(path: str) -> dict:
    """The checked manifest of the current checkpoint under `path` (CheckpointError if bad)."""
    return load_manifest(checkpoint_dir(path))


DTYPES_FLOAT = {"torch.float64": True, "torch.float32": True, "torch.float16": True,
                "torch.bfloat16": True}  # fmt: skip


@dataclass(frozen=True)
class _StateOf:
    """Expected shape of a parameter (slice) whose optimizer state is being loaded."""

    shape: tuple


class _Problems(list):
    def add(self, message: str) -> None:
        self.append(message)


def _expected(model: nn.Module, opt, manifest: dict, problems: _Problems) -> list:
    """(key, expected shape, expected dtype) of every tensor this rank loads, plus checks
    that the checkpoint has no tensor this model lacks and the expert counts agree."""
    experts = _expert_params(model)
    stored = manifest["tensors"]
    want = []
    model_names = set()
    stored_ids: dict[str, list[int]] = {}
    for e in stored.values():
        if e["kind"] == "model" and e["expert"] is not None:
            stored_ids.setdefault(e["name"], []).append(e["expert"])
    for name, t in model.state_dict(keep_vars=True).items():
        model_names.add(name)
        if name in experts:
            module = experts[name][0]
            ids = sorted(stored_ids.get(name, []))
            if ids and ids != list(range(module.num_global_experts)):
                problems.add(
                    f"model/{name}: checkpoint holds experts {ids[0]}..{ids[-1]} "
                    f"({len(ids)}), the model has {module.num_global_experts} experts"
                )
            for i in range(t.shape[0]):
                item = _Item("model", name, None, module.expert_offset + i)
                want.append((item, tuple(t.shape[1:]), t.dtype))
        else:
            want.append((_Item("model", name), tuple(t.shape), t.dtype))
    managed = _optimizer_index(opt) if opt is not None else {}
    params = dict(model.named_parameters())
    for entry in stored.values():
        if entry["kind"] == "model" and entry["name"] not in model_names:
            problems.add(f"model/{entry['name']}: in the checkpoint but not in the model")
        if entry["kind"] == "optim" and opt is not None:
            p = params.get(entry["name"])
            if p is None or id(p) not in managed:
                problems.add(
                    f"optim/{entry['name']}/{entry['state']}: in the checkpoint but not a "
                    "parameter of this optimizer"
                )
    if opt is None:
        return want
    state_keys: dict[str, set] = {}
    for entry in stored.values():
        if entry["kind"] == "optim":
            state_keys.setdefault(entry["name"], set()).add(entry["state"])
    for name, p in params.items():
        if id(p) not in managed:
            continue
        for key in sorted(state_keys.get(name, ())):
            if name in experts:
                module = experts[name][0]
                for i in range(p.shape[0]):
                    item = _Item("optim", name, key, module.expert_offset + i)
                    want.append((item, _StateOf(tuple(p.shape[1:])), None))
            else:
                want.append((_Item("optim", name, key), _StateOf(tuple(p.shape)), None))
    return want


def _read(directory: str, entry: dict, key: str, problems: _Problems) -> torch.Tensor | None:
    try:
        return read_tensor(directory, key, entry)
    except CheckpointError as e:
        problems.add(str(e))
        return None


def _load_all(directory: str, manifest: dict, want: list, problems: _Problems) -> dict:
    stored = manifest["tensors"]
    loaded = {}
    for item, shape, dtype in want:
        entry = stored.get(item.key)
        if entry is None:
            problems.add(f"{item.key}: missing from the checkpoint")
            continue
        if isinstance(shape, _StateOf):  # optimizer state: a scalar or the parameter's shape
            if tuple(entry["shape"]) not in ((), shape.shape) or (
                entry["shape"] and not DTYPES_FLOAT.get(entry["dtype"], False)
            ):
                problems.add(
                    f"{item.key}: optimizer state {entry['dtype']}{tuple(entry['shape'])} does "
                    f"not fit its parameter of shape {shape.shape} (expected a scalar or a "
                    "floating tensor of that shape)"
                )
                continue
        elif shape is not None and tuple(entry["shape"]) != shape:
            problems.add(
                f"{item.key}: checkpoint shape {tuple(entry['shape'])}, model expects {shape}"
            )
            continue
        if dtype is not None and entry["dtype"] != str(dtype):
            problems.add(f"{item.key}: checkpoint dtype {entry['dtype']}, model expects {dtype}")
            continue
        t = _read(directory, entry, item.key, problems)
        if t is not None:
            loaded[item] = (t, entry.get("python"))
    return loaded


def _agree(problems: _Problems) -> None:
    """Raise on every rank if any rank found a problem (no rank loads half a checkpoint)."""
    rank, world = _world()
    if world > 1:
        everyone = all_gather_records({str(i): m for i, m in enumerate(problems)})
        lines = [f"rank {r}: {m}" for r, ms in enumerate(everyone) for m in ms.values()]
    else:
        lines = list(problems)
    if lines:
        shown = "\n  ".join(lines[:20])
        more = f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else ""
        raise CheckpointError(f"checkpoint does not match (nothing was loaded):\n  {shown}{more}")


def _gather_state(loaded: dict, model: nn.Module, problems: _Problems) -> dict[str, dict]:
    """Parameter name -> {state key: tensor}, expert slices stacked in local order."""
    experts = _expert_params(model)
    pieces: dict[tuple[str, str], list] = {}
    for item, (t, python) in loaded.items():
        if item.kind == "optim":
            pieces.setdefault((item.name, item.state), []).append((item.expert, t, python))
    out: dict[str, dict] = {}
    for (name, key), parts in pieces.items():
        parts.sort(key=lambda x: -1 if x[0] is None else x[0])
        python = parts[0][2]
        if name not in experts:
            value = parts[0][1]
        elif parts[0][1].dim() == 0:  # per-tensor scalar (e.g. step): equal on every slice
            value = parts[0][1]
            if any(not torch.equal(p[1], value) for p in parts):
                problems.add(f"optim/{name}/{key}: differs between experts; cannot reshard")
        else:
            value = torch.stack([p[1] for p in parts])
        if python is not None:
            value = {"int": int, "float": float, "bool": bool}[python](value.item())
        out.setdefault(name, {})[key] = value
    return out


@torch.no_grad()
def load_checkpoint(path: str, model: nn.Module, opt=None) -> dict:
    """Load the checkpoint under `path` into `model` (at any EP size) and optimizer `opt`.
    Collective when distributed. Validates everything first; a mismatched, truncated or
    corrupted checkpoint raises ValueError naming the tensor and loads nothing. Returns the
    `extra` metadata saved with it."""
    directory = checkpoint_dir(path)
    manifest = read_manifest(path)
    problems = _Problems()
    want = _expected(model, opt, manifest, problems)
    loaded = _load_all(directory, manifest, want, problems) if not problems else {}
    states = _gather_state(loaded, model, problems) if not problems else {}
    _agree(problems)
    experts = _expert_params(model)
    model_state = model.state_dict(keep_vars=True)
    for name, t in model_state.items():
        if name in experts:
            off = experts[name][0].expert_offset
            slices = [loaded[_Item("model", name, None, off + i)][0] for i in range(t.shape[0])]
            t.copy_(torch.stack(slices))
        else:
            t.copy_(loaded[_Item("model", name)][0])
    if opt is not None:
        _load_optimizer(opt, model, states, manifest.get("optimizer"))
    return manifest.get("extra", {})


def _load_optimizer(opt, model: nn.Module, states: dict[str, dict], meta: dict | None) -> None:
    index = _optimizer_index(opt)
    by_index = {
        index[id(p)]: states.get(n, {}) for n, p in model.named_parameters() if id(p) in index
    }
    saved_groups = [
        {k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}
        for g in (meta or {}).get("param_groups", [])
    ]
    if hasattr(opt, "load_param_states"):
        opt.load_param_states(by_index)
        opt.load_hyperparameters(saved_groups)
        scaler = (meta or {}).get("loss_scaler")
        if scaler and getattr(opt, "loss_scaler", None) is not None:
            opt.loss_scaler.load_state_dict(scaler)
        return
    current = opt.state_dict()["param_groups"]
    groups = current
    if len(saved_groups) == len(current):
        groups = [{**s, "params": c["params"]} for s, c in zip(saved_groups, current)]
    opt.load_state_dict({"state": {i: s for i, s in by_index.items() if s}, "param_groups": groups})
