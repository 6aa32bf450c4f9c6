"""Model and optimizer state as (flat tensors for DCP, JSON objects), and back.

Keys: "model/<fqn>" for weights and buffers, "optim/<fqn>/<state key>" for optimizer state,
with <fqn> the parameter's name in the unwrapped model, so every layout saves the same keys
and global shapes (DTensor parameters: torch's get_*_state_dict). Non-tensor values
(hyperparameters, integer steps, None buffers, the loss scaler) go to JSON.
"""

import math

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from moe.checkpoint import base, replicas, slots, validate
from moe.checkpoint.errors import CheckpointError
from moe.checkpoint.metadata import LAYOUT, TensorEntry, dtype_name
from moe.checkpoint.parts import is_partial, layout_of
from moe.checkpoint.validate import NOT_RESTORED
from moe.memory.grouped_apply import GroupedApply


def _is_grouped(opt) -> bool:
    return isinstance(opt, GroupedApply)


def _json_value(value, where: str):
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v, where) for v in value]
    raise CheckpointError(f"{where}: cannot store a {type(value).__name__} as JSON")


def _hyper(group: dict, where: str) -> dict:
    return {k: _json_value(v, f"{where}.{k}") for k, v in group.items() if k not in NOT_RESTORED}


def _named_managed(model: nn.Module, opt) -> dict[str, nn.Parameter]:
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


def _optimizer_state(model: nn.Module, opt) -> tuple[dict, list]:
    """({fqn: {key: value}}, param_groups with fqn lists) for either optimizer kind."""
    if _is_grouped(opt):
        named = _named_managed(model, opt)
        state = {n: s for n, p in named.items() if (s := opt.state_of(p))}
        fqn = {id(p): n for n, p in named.items()}
        groups = [{**g, "params": [fqn[id(p)] for p in g["params"]]} for g in opt.param_groups]
        return state, groups
    osd = get_optimizer_state_dict(model, opt)
    return osd["state"], osd["param_groups"]


def check_layout(model: nn.Module) -> None:
    """Expert-parallel shards must be DTensors (global shape): plain local expert slices
    would be saved as if they were the whole tensor."""
    from torch.distributed.tensor import DTensor

    from moe.experts import GroupedExperts

    for name, m in model.named_modules():
        if not isinstance(m, GroupedExperts) or m.num_experts == m.num_global_experts:
            continue
        if any(not isinstance(p, DTensor) for p in m.parameters(recurse=False)):
            raise CheckpointError(
                f"{name}: holds {m.num_experts} of {m.num_global_experts} experts as plain "
                "tensors; checkpoints need the DTensor parameters of moe.parallel.parallelize"
            )


def trainable_names(model: nn.Module) -> set[str]:
    """Names of the parameters that train (requires_grad): what trainable_only saves."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _model_state(model: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The model's state dict, or with trainable_only its trainable parameters alone (e.g.
    moe.lora's adapters: the frozen base comes from its own checkpoint)."""
    state = get_model_state_dict(model)
    if not trainable_only:
        return state
    keep = trainable_names(model)
    return {k: v for k, v in state.items() if k in keep}


def collect(
    model: nn.Module, opt, trainable_only: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """Everything to save: tensors by key, and the JSON objects."""
    check_layout(model)
    layouts = slots.layouts_to_save(model)  # checked first; replica placement (resume exactly)
    tensors = {f"model/{k}": v for k, v in _model_state(model, trainable_only).items()}
    objects: dict = {"optimizer": None, "moe_layers": validate.moe_settings(model)}
    objects["trainable_only"] = trainable_only
    if trainable_only:  # the frozen base it trains on, refused as another at load
        objects[base.KEY] = base.fingerprint(model)
    objects[slots.KEY] = layouts
    objects[LAYOUT] = layout_of(model)
    if opt is None:
        replicas.to_canonical(model, tensors)
        return tensors, objects
    state, groups = _optimizer_state(model, opt)
    values: dict[str, dict] = {}
    for fqn, s in state.items():
        for key, v in s.items():
            if isinstance(v, torch.Tensor):
                dtype_name(v.dtype)
                tensors[f"optim/{fqn}/{key}"] = v
            else:
                values.setdefault(fqn, {})[key] = _json_value(v, f"optim/{fqn}/{key}")
    replicas.to_canonical(model, tensors)
    scaler = validate.loss_scaler_of(opt)
    objects["optimizer"] = {
        "class": validate.algorithm_name(opt),
        "state_values": values,
        "param_groups": [
            {**_hyper(g, f"param_groups[{i}]"), "params": list(g["params"])}
            for i, g in enumerate(groups)
        ],
        "loss_scaler": _json_value(scaler.state_dict(), "loss_scaler") if scaler else None,
    }
    return tensors, objects


def _check(key: str, entry: TensorEntry | None, shape, dtype, problems: list) -> bool:
    if entry is None:
        problems.append(f"{key}: missing from the checkpoint")
    elif tuple(entry.shape) != tuple(shape) or entry.dtype != dtype:
        problems.append(
            f"{key}: checkpoint has {dtype_name(entry.dtype)}{list(entry.shape)}, "
            f"expected {dtype_name(dtype)}{list(shape)}"
        )
    else:
        return True
    return False


def targets(
    model, opt, stored: dict[str, TensorEntry], objects: dict, problems: list, allow_change: bool
) -> dict:
    """Empty tensors (same layout as the live ones) to load into, after checking every
    stored key, shape and dtype against the model and optimizer, and every JSON value that
    `apply` will set (moe.checkpoint.validate). A model in parts (moe.checkpoint.parts)
    checks its own keys here; what no rank holds is found across ranks (claims)."""
    partial = is_partial(model)
    check_layout(model)
    validate.check_saved_layer_configs(
        model, objects.get("moe_layers"), allow_change, problems, partial
    )
    slots.check_objects(model, objects, problems)
    out = {}
    only = objects.get("trainable_only", False)
    if not isinstance(only, bool):
        problems.append("objects.trainable_only: expected true or false")
        only = False
    if only:
        base.check(model, objects.get(base.KEY), problems, allow_change)
    for k, v in _model_state(model, only).items():
        if k.endswith("slot_of_expert_E") and f"model/{k}" not in stored:
            continue  # saved before expert placement existed: MoELayer loads canonical order
        v = replicas.canonical_like(model, f"model/{k}", v)  # replicas: stored canonical
        if v is None:
            continue
        if _check(f"model/{k}", stored.get(f"model/{k}"), v.shape, v.dtype, problems):
            out[f"model/{k}"] = torch.empty_like(v)
    model_keys = {f"model/{k}" for k in get_model_state_dict(model)}
    unknown = [k for k in stored if k.startswith("model/") and k not in model_keys]
    if partial:  # another rank's part, or no rank's: checked across ranks
        unknown = []
    problems += [f"{k}: in the checkpoint but not in the model" for k in unknown]
    if opt is None:
        return out
    if not isinstance(objects.get("optimizer"), dict):
        problems.append("optimizer: the checkpoint holds no optimizer state")
        return out
    named = _named_managed(model, opt)
    saved: dict[str, set] = {}
    for k in stored:
        if k.startswith("optim/"):
            fqn, _, key = k[len("optim/") :].rpartition("/")
            if fqn not in named and not partial:
                problems.append(f"{k}: in the checkpoint but not a parameter of this optimizer")
            saved.setdefault(fqn, set()).add(key)
    grouped = _is_grouped(opt)
    live = {} if grouped else get_optimizer_state_dict(model, opt)["state"]
    live_state = {n: opt.state_of(p) for n, p in named.items()} if grouped else live
    validate.check_optimizer(opt, objects, named, live_state, problems, partial)
    for fqn, p in named.items():
        for key in sorted(saved.get(fqn, ())):
            k, entry = f"optim/{fqn}/{key}", stored[f"optim/{fqn}/{key}"]
            ref = live.get(fqn, {}).get(key)
            if isinstance(ref, torch.Tensor):
                ref = replicas.canonical_like(model, k, ref)
            if not grouped and not isinstance(ref, torch.Tensor):
                problems.append(f"{k}: this optimizer ({type(opt).__name__}) has no such state")
            elif ref is not None:
                if _check(k, entry, ref.shape, ref.dtype, problems):
                    out[k] = torch.empty_like(ref)
            elif math.prod(entry.shape) == 1 and len(entry.shape) == 0:
                out[k] = torch.empty((), dtype=entry.dtype)
            elif _check(
                k,
                entry,
                (like := replicas.canonical_like(model, k, p)).shape,
                entry.dtype,
                problems,
            ):  # GroupedApply state: replicas stored canonical
                if not entry.dtype.is_floating_point:
                    problems.append(f"{k}: dtype {dtype_name(entry.dtype)} is not floating point")
                else:
                    out[k] = torch.empty_like(like, dtype=entry.dtype)
    return out


def claims(model, opt, stored: dict[str, TensorEntry]) -> dict[str, set]:
    """What this rank holds of the stored names (moe.checkpoint.parts.unclaimed)."""
    model_keys = {f"model/{k}" for k in get_model_state_dict(model)}
    named = _named_managed(model, opt) if opt is not None else {}
    optim = {k for k in stored if k.startswith("optim/") and k[6:].rpartition("/")[0] in named}
    return {
        "tensors": (model_keys & set(stored)) | optim,
        "layers": set(validate.moe_settings(model)),
        "states": set(named),
    }


def _restore_group(saved: dict, live: dict) -> dict:
    hyper = {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in saved.items()}
    return {**live, **{k: v for k, v in hyper.items() if k not in NOT_RESTORED}}


@torch.no_grad()
def apply(model, opt, loaded: dict[str, torch.Tensor], objects: dict) -> None:
    """Copy validated, fully read tensors into the model and optimizer."""
    slots.restore(model, objects)  # the saved replica layout, where it fits
    model_sd = {k[len("model/") :]: v for k, v in loaded.items() if k.startswith("model/")}
    live = get_model_state_dict(model)
    layout = replicas.live_layout(model)
    saved_slots = {k: model_sd[k] for k in layout if k in model_sd}  # rows' stored order
    model_sd = {k: _to_slots(model, k, v, live, saved_slots) for k, v in model_sd.items()}
    model_sd.update(layout)  # replicated layers keep their live slot map
    partial = objects.get("trainable_only", False) is True  # the frozen rest stays as it is
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=not partial))
    if opt is None:
        return
    meta = objects["optimizer"]
    state: dict[str, dict] = {}
    for k, v in loaded.items():
        if k.startswith("optim/"):
            fqn, _, key = k[len("optim/") :].rpartition("/")
            state.setdefault(fqn, {})[key] = v
    named = _named_managed(model, opt)
    for fqn, values in meta.get("state_values", {}).items():
        if fqn in named:  # a model in parts: this rank's parameters only
            state.setdefault(fqn, {}).update(values)
    for fqn, values in state.items():
        for key, v in values.items():
            if isinstance(v, torch.Tensor):
                values[key] = _to_slots(model, fqn, v, live, saved_slots, f"optim/{fqn}/{key}")
    saved_groups = meta.get("param_groups", [])
    if _is_grouped(opt):
        opt.load_param_states({opt.index_of(named[f]): s for f, s in state.items()})
        opt.load_hyperparameters([_restore_group(g, {}) for g in saved_groups])
        scaler = meta.get("loss_scaler")
        if scaler and opt.loss_scaler is not None:
            opt.loss_scaler.load_state_dict(scaler)
        return
    groups = get_optimizer_state_dict(model, opt)["param_groups"]
    if len(saved_groups) == len(groups):
        groups = [_restore_group(s, g) for s, g in zip(saved_groups, groups)]
    set_optimizer_state_dict(model, opt, {"state": state, "param_groups": groups})


def _to_slots(model, fqn, v, live, saved_slots, key=None):
    """A replicated layer's stored expert rows (canonical, or in a stored placement's slot
    order) in the live slot layout; anything else unchanged."""
    key = key or f"model/{fqn}"
    layers = replicas.replica_layers(model)
    hit = replicas._expert_fqn(key, layers)
    if hit is None or not isinstance(v, torch.Tensor) or v.dim() == 0:
        return v
    order = saved_slots.get(f"{hit[1]}slot_of_expert_E")
    if order is not None:
        v = v.index_select(0, order.to(v.device))
    param = fqn if key.startswith("model/") else key[len("optim/") :].rpartition("/")[0]
    return replicas.to_slots(model, key, v, live[param])
