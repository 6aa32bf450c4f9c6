"""MoEConfig: every option of an MoE layer, validated at construction.

The core options are declared here (CoreConfig); each feature package adds one field, its
settings (moe.names.FEATURE_SETTINGS: the field's name and the settings type), so the options
and their checks name no feature.
"""

import importlib
import math
import types
import typing
from dataclasses import dataclass, field, fields, make_dataclass, replace

from moe.names import (
    ACTIVATIONS,
    BACKENDS,
    BALANCE_LOSSES,
    DROP_POLICIES,
    FEATURE_SETTINGS,
    RETIRED,
    ROUTERS,
    ROW_FORMAT_NAMES,
    SCORE_FUNCS,
    SEQUENCE_ROUTERS,
    WEIGHT_FORMAT_NAMES,
)

MAX_INT = 2**31 - 1  # sizes and counts: expert offsets are int32 on device
MAX_FACTOR = 1e4
# Upper bounds of the float options, so that no value overflows in forward (1e308 * k * T is
# inf) or means nothing (a jitter eps above 1 can flip an input's sign; a bias step above 1
# dwarfs every routing score). Lower bounds are checked in __post_init__.
FLOAT_MAX = {
    "capacity_factor": MAX_FACTOR,
    "eval_capacity_factor": MAX_FACTOR,
    "route_scale": MAX_FACTOR,
    "jitter_eps": 1.0,
    "aux_loss_coef": MAX_FACTOR,
    "z_loss_coef": MAX_FACTOR,
    "bias_update_rate": 1.0,
}


def settings(type_path: str):
    """A field holding a feature's settings (a dataclass defined in the feature's package, at
    `type_path`), or None. Its type is imported only when a value is given, so moe.config loads
    no feature; a dict (as asdict / JSON give it back) is turned into the type."""
    return field(default=None, metadata={"settings": type_path})


def _settings_value(f, value):
    if value is None:
        return None
    module, _, name = f.metadata["settings"].rpartition(".")
    kind = getattr(importlib.import_module(module), name)
    if isinstance(value, dict):
        try:
            return kind(**value)
        except TypeError as e:  # an unknown key
            raise ValueError(f"{f.name}: {e}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{f.name} must be {name} or None, got {value!r} ({type(value).__name__})")
    return value


@dataclass(frozen=True)
class CoreConfig:
    """Options of one MoE layer (MoEConfig: these, and one settings field per feature). Bad
    values raise ValueError naming the field.

    Capacity per expert is ceil(capacity_factor * top_k * T / E), at least `min_capacity`
    (and at most T); `capacity_factor=None` is dropless. Expert choice uses
    C = ceil(capacity_factor * T / E) tokens per expert (capacity_factor defaults to top_k).

    Every number is finite and bounded: ints are at most MAX_INT (2**31 - 1); capacity
    factors, route_scale and the loss coefficients at most MAX_FACTOR (1e4); jitter_eps and
    bias_update_rate at most 1 (FLOAT_MAX).
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int = 2
    router: str = "topk"
    capacity_factor: float | None = None  # in (0, 1e4]; None: dropless
    eval_capacity_factor: float | None = None  # in (0, 1e4]; None: same as capacity_factor
    min_capacity: int = 4
    drop_policy: str = "position"  # "position": token order, first choices first; "probs"
    score_func: str = "softmax"  # "softmax" or "sigmoid"
    softmax_before_topk: bool = True  # False: top-k on logits, then softmax over the k
    normalize_weights: bool = False  # renormalise the k combine weights to sum to 1
    route_scale: float = 1.0  # combine weights are multiplied by it; in (0, 1e4]
    num_groups: int = 1  # group-limited routing: experts split into groups...
    topk_groups: int = 1  # ...and tokens pick experts only inside their best groups
    jitter_eps: float = 1e-2  # switch: input jitter U(1-eps, 1+eps) in training; in [0, 1]
    aux_loss_coef: float = 1e-2  # in [0, 1e4], as z_loss_coef
    balance_loss: str = "batch"  # "batch" | "sequence" (DeepSeek-V3) | "global": see balance.py
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0  # in (0, 1]: aux-loss-free balancing by a per-expert bias
    activation: str = "gelu"
    bias: bool = False
    backend: str = "auto"
    num_shared_experts: int = 0  # > 0: a dense MLP every token also goes through (DeepSeek-V3)
    shared_d_ff: int | None = None  # its width; None: d_ff * num_shared_experts
    shared_expert_gate: bool = False  # scale the shared output by sigmoid(Linear(d, 1)) (Qwen2)
    recompute: bool = False  # recompute the layer in backward (activation checkpointing)
    check_finite: bool = False  # debug: NaN/Inf in an expert's weights or outputs raises (syncs)
    spare_slots: int = 0  # R extra expert slots holding copies of hot experts (replicas.py)
    weight_format: str = "dense"  # how the experts store weights (moe.kernels.weight_format)
    row_format: str = "plain"  # how dispatched rows travel (moe.dispatch.wire)

    def __post_init__(self):
        for f in fields(self):
            if "settings" in f.metadata:  # a feature's settings type, loaded only when given
                object.__setattr__(self, f.name, _settings_value(f, getattr(self, f.name)))
                continue
            _check_type(f.name, getattr(self, f.name), f.type)
            _check_upper_bound(f.name, getattr(self, f.name))
        for (name, old), chooser in RETIRED.items():  # as an older release recorded it
            if getattr(self, name) == old:
                if getattr(self, chooser) is None:
                    raise ValueError(f"{name}={old!r} is retired: MoEConfig.{chooser} chooses it")
                object.__setattr__(self, name, _DEFAULTS[name])
        for name in ("d_model", "d_ff", "num_experts", "top_k", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None (dropless), got {value!r}")
        if self.num_shared_experts < 0 or (self.shared_d_ff is not None and self.shared_d_ff <= 0):
            raise ValueError(
                f"num_shared_experts must be >= 0 and shared_d_ff > 0 or None, got "
                f"{self.num_shared_experts}, {self.shared_d_ff}"
            )
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError("shared_expert_gate=True needs num_shared_experts > 0")
        if self.spare_slots < 0:
            raise ValueError(f"spare_slots must be >= 0, got {self.spare_slots}")
        if self.spare_slots and self.router == "expert_choice":
            raise ValueError("spare_slots (expert replicas) needs a token-choice router")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")
        _choose("drop_policy", self.drop_policy, DROP_POLICIES)
        _choose("score_func", self.score_func, SCORE_FUNCS)
        _choose("activation", self.activation, ACTIVATIONS)
        _choose("backend", self.backend, BACKENDS)
        _choose("weight_format", self.weight_format, WEIGHT_FORMAT_NAMES)
        _choose("row_format", self.row_format, ROW_FORMAT_NAMES)
        _choose("balance_loss", self.balance_loss, BALANCE_LOSSES)
        if self.balance_loss != "batch" and self.router not in SEQUENCE_ROUTERS:
            raise ValueError(
                f"balance_loss={self.balance_loss!r} needs router in {SEQUENCE_ROUTERS}, "
                f"got router={self.router!r}"
            )
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"num_groups={self.num_groups} must divide num_experts={self.num_experts}"
            )
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_groups={self.topk_groups} exceeds num_groups={self.num_groups}")
        if self.num_groups > 1 and self.top_k > self.topk_groups * (
            self.num_experts // self.num_groups
        ):
            raise ValueError("top_k exceeds the experts available in topk_groups groups")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "jitter_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.route_scale <= 0:
            raise ValueError(f"route_scale must be > 0, got {self.route_scale}")
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r} is unknown; registered: {sorted(ROUTERS)}")
        ROUTERS[self.router].check_config(self)

    def replace(self, **changes) -> "MoEConfig":
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


_DEFAULTS = {f.name: f.default for f in fields(CoreConfig)}

MoEConfig = make_dataclass(
    "MoEConfig",
    [(name, object, settings(type_path)) for name, type_path in FEATURE_SETTINGS.items()],
    bases=(CoreConfig,),
    frozen=True,
    namespace={"__module__": __name__, "__doc__": CoreConfig.__doc__},
)


def upgrade_saved(config: dict) -> dict:
    """A saved MoEConfig (asdict / JSON) as today's MoEConfig reads it: a value an older release
    recorded for a setting that a feature's field now chooses (moe.names.RETIRED) becomes the
    setting's default where that field is set. For readers that compare saved settings."""
    config = dict(config)
    for (name, old), chooser in RETIRED.items():
        if config.get(name) == old and config.get(chooser) is not None:
            config[name] = _DEFAULTS[name]
    return config


def _check_upper_bound(name: str, value) -> None:
    """Ints at most MAX_INT, the floats of FLOAT_MAX at most their bound (ValueError)."""
    if isinstance(value, bool) or value is None:
        return
    limit = MAX_INT if isinstance(value, int) and name not in FLOAT_MAX else FLOAT_MAX.get(name)
    if limit is not None and value > limit:
        shown = limit if isinstance(limit, int) else f"{limit:g}"
        text = repr(value)
        text = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"
        raise ValueError(f"{name} must be <= {shown}, got {text}")


def _choose(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


def _check_type(name: str, value, annotation) -> None:
    """Type and finiteness of one field, from its declared type: int (not bool), float (an int
    or float, finite), bool, str, and `X | None`. A ValueError names the field."""
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    if allowed and value is None and type(None) in allowed:
        return
    kind = next((a for a in allowed if a is not type(None)), annotation)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = kind.__name__ + (" or None" if allowed else "")
        raise ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
