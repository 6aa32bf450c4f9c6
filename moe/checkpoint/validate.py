"""Checks of every non-tensor value a load will apply, run before the first tensor changes:
optimizer hyper-parameters (type of the live value, finite, in range), JSON optimizer state
(`step`), the loss scaler, and the MoE settings of each layer saved with the checkpoint."""

import json
import math
from dataclasses import asdict

import torch
from torch import nn

from moe.config import upgrade_saved
from moe.memory.grouped_apply import GroupedApply

# Implementation switches belong to the optimizer being loaded into, not to the checkpoint.
NOT_RESTORED = {"params", "foreach", "fused", "capturable", "differentiable"}
# MoEConfig fields that choose how a layer runs, not what it computes: they may differ.
# "checkpoint": recompute's old name, in checkpoints saved before the rename; spare slots:
# checkpoints are canonical
# fp8, row_format: how a layer computes or sends its rows (a number format), not its weights: a
# checkpoint saved with FP8 or a row format on loads with it off and back (the masters are
# stored in their dtype). weight_format is not here: it changes what the layer stores.
MOE_RUNTIME_FIELDS = {
    "backend",
    "recompute",
    "checkpoint",
    "check_finite",
    "spare_slots",
    "fp8",
    "row_format",
}
_NONNEGATIVE = {"lr", "initial_lr", "eps", "weight_decay", "momentum", "dampening", "alpha"}
# No optimizer trains with a larger step; lr=1e308 makes the parameters non-finite in one step.
MAX_LR = 1e4
_AT_MOST = {"lr": MAX_LR, "initial_lr": MAX_LR, "max_lr": MAX_LR}
LEGACY_CLASS = "GroupedApply"  # what releases before issue 32 recorded for any GroupedApply


def algorithm_name(opt) -> str:
    """The optimizer's algorithm, saved as `class`: a GroupedApply's inner optimizer class
    (GroupedApply(AdamW) and AdamW hold the same state), else the optimizer's own class."""
    return (opt.optimizer_class if isinstance(opt, GroupedApply) else type(opt)).__name__


def loss_scaler_of(opt):
    """The optimizer's dynamic loss scaler (GroupedApply's; None for a torch optimizer)."""
    return opt.loss_scaler if isinstance(opt, GroupedApply) else None


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _value_problem(value, ref, where: str, name: str) -> str | None:
    """Why `value` (from the checkpoint) cannot replace the live `ref`, or None."""
    if isinstance(value, list) and ref is None:  # a value the live optimizer lacks
        ref = [None] * len(value)
    if isinstance(ref, tuple | list):
        if not isinstance(value, list) or len(value) != len(ref):
            return f"{where}: expected a list of {len(ref)} values, got {value!r:.80}"
        for i, (v, r) in enumerate(zip(value, ref)):
            if problem := _value_problem(v, r, f"{where}[{i}]", name):
                return problem
        if name == "betas" and not all(_is_number(b) and 0 <= b < 1 for b in value):
            return f"{where}: betas must lie in [0, 1), got {value!r:.80}"
        return None
    if isinstance(value, list):
        return f"{where}: expected {type(ref).__name__}, got a list"
    if isinstance(ref, bool) and not isinstance(value, bool):
        return f"{where}: expected bool, got {value!r:.80}"
    if (_is_number(ref) or isinstance(ref, torch.Tensor)) and not _is_number(value):
        return f"{where}: expected a number, got {value!r:.80}"
    if isinstance(ref, str) and not isinstance(value, str):
        return f"{where}: expected str, got {value!r:.80}"
    if _is_number(value) and not math.isfinite(value):
        return f"{where}: {value!r} is not finite"
    if _is_number(value) and name in _NONNEGATIVE and value < 0:
        return f"{where}: must be >= 0, got {value!r}"
    if _is_number(value) and name in _AT_MOST and value > _AT_MOST[name]:
        return f"{where}: must be at most {_AT_MOST[name]:g}, got {value!r}"
    return None


def _groups(opt, saved: list, problems: list) -> None:
    live = opt.param_groups
    grouped = isinstance(opt, GroupedApply)
    saved = [{k: v for k, v in g.items() if k not in NOT_RESTORED} for g in saved]
    if len(saved) != len(live):
        if not grouped:
            return  # a torch optimizer keeps its own groups then (nothing is applied)
        if any(s != saved[0] for s in saved):
            problems.append(
                f"optimizer: cannot map {len(saved)} saved groups with different "
                f"hyper-parameters onto {len(live)} apply groups"
            )
            return
        saved = [saved[0]] * len(live)
    for i, (group, ref) in enumerate(zip(saved, live)):
        for key, value in group.items():
            where = f"optimizer param_groups[{i}].{key}"
            if problem := _value_problem(value, ref.get(key), where, key):
                problems.append(problem)


def _state_values(opt, values: dict, named: dict, live: dict, problems: list, partial) -> None:
    for fqn, state in values.items():
        if fqn not in named:  # a model in parts: another rank's, or none's (moe.checkpoint.parts)
            if not partial:
                problems.append(f"optimizer state of {fqn!r}: not a parameter of this optimizer")
            continue
        for key, value in state.items():
            where = f"optimizer state {fqn}/{key}"
            ref = live.get(fqn, {}).get(key)
            if isinstance(ref, torch.Tensor):
                problems.append(f"{where}: this optimizer holds a tensor there, not {value!r:.80}")
            elif problem := _value_problem(value, ref, where, key):
                problems.append(problem)
            elif key == "step" and not (_is_number(value) and value >= 0):
                problems.append(f"{where}: expected a number >= 0, got {value!r:.80}")


def _loss_scaler(saved, problems: list) -> None:
    if saved is None:
        return
    if not isinstance(saved, dict):
        problems.append(f"optimizer loss_scaler: expected a JSON object, got {saved!r:.80}")
        return
    scale = saved.get("scale")
    if not _is_number(scale) or not math.isfinite(scale) or scale <= 0:
        problems.append(
            f"optimizer loss_scaler.scale: expected a finite number > 0, got {scale!r:.80}"
        )
    for key in ("good_steps", "skipped"):
        value = saved.get(key, 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            problems.append(f"optimizer loss_scaler.{key}: expected an int >= 0, got {value!r:.80}")


def check_optimizer(
    opt, objects: dict, named: dict, live_state: dict, problems: list, partial: bool = False
) -> None:
    """Hyper-parameters, JSON state values and the loss scaler that `apply` will set (`partial`:
    the model is this rank's part of it, state of other parameters is not this rank's)."""
    meta = objects.get("optimizer")
    if opt is None or not isinstance(meta, dict):
        return
    saved_class, live_class = meta.get("class"), algorithm_name(opt)
    if saved_class not in (None, live_class, LEGACY_CLASS):
        problems.append(
            f"optimizer: the checkpoint holds the state of {saved_class!r:.80}, the optimizer "
            f"given is {live_class!r}"
        )
        return  # its state and hyper-parameters mean something else
    if not meta.get("param_groups", [None]):
        problems.append("optimizer param_groups: empty (a saved optimizer has at least one group)")
        return
    _groups(opt, meta.get("param_groups", []), problems)
    _state_values(opt, meta.get("state_values", {}), named, live_state, problems, partial)
    if loss_scaler_of(opt) is not None:
        _loss_scaler(meta.get("loss_scaler"), problems)


def moe_settings(model: nn.Module) -> dict:
    """Every MoE layer's full MoEConfig, saved with the checkpoint."""
    from moe.layer import moe_layers

    # through JSON, as the saved copy comes back (a settings tuple, LoRAConfig.targets, a list)
    return {name: json.loads(json.dumps(asdict(layer.config))) for name, layer in moe_layers(model)}


def check_saved_layer_configs(
    model: nn.Module, saved, allow_change: bool, problems: list, partial: bool = False
) -> None:
    """The model's MoE layers must have the settings they were saved with (a checkpoint
    without them, from an older release, is not checked); `partial`: the model is this rank's
    part of it (saved layers it lacks are checked across ranks, moe.checkpoint.parts)."""
    if saved is None:
        return
    if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
        problems.append("metadata: objects.moe_layers must map layer names to settings")
        return
    if allow_change:
        return
    live = moe_settings(model)
    for name in [] if partial else sorted(set(saved) - set(live)):
        problems.append(f"MoE layer {name!r}: in the checkpoint but not in the model")
    for name, config in live.items():
        if name not in saved:
            problems.append(f"MoE layer {name!r}: in the model but not in the checkpoint")
            continue
        for field, value in upgrade_saved(saved[name]).items():  # old values read as today's
            if field in MOE_RUNTIME_FIELDS:
                continue
            if field not in config:
                problems.append(f"MoE layer {name!r}: unknown setting {field!r} in the checkpoint")
            elif value != config[field] or isinstance(value, bool) != isinstance(
                config[field], bool
            ):
                problems.append(
                    f"MoE layer {name!r}: {field}={value!r:.40} in the checkpoint, "
                    f"{field}={config[field]!r:.40} in the model (pass allow_config_change=True "
                    "to load anyway)"
                )


def check_objects(objects: dict) -> None:
    """The JSON structure of the optimizer and `extra` objects (raises CheckpointError)."""
    from moe.checkpoint.errors import CheckpointError
    from moe.checkpoint.metadata import LAYOUT, parse_layout

    parse_layout(objects.get(LAYOUT))
    opt = objects.get("optimizer")
    if not isinstance(objects.get("extra", {}), dict):
        raise CheckpointError("metadata: objects.extra is not a JSON object")
    if opt is None:
        return
    ok = (
        isinstance(opt, dict)
        and isinstance(opt.get("state_values", {}), dict)
        and all(isinstance(v, dict) for v in opt.get("state_values", {}).values())
        and isinstance(opt.get("param_groups", []), list)
        and all(isinstance(g, dict) for g in opt.get("param_groups", []))
        and isinstance(opt.get("loss_scaler") or {}, dict)
    )
    if not ok:
        raise CheckpointError("metadata: objects.optimizer is malformed")
