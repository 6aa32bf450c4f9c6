"""ExchangeConfig: how the expert-parallel all-to-all runs, the declared home of its settings.

`moe.parallel.parallelize(..., exchange=ExchangeConfig(...))` hands it to the dispatchers,
which pass it to every exchange they plan (given none, parallelize builds `ExchangeConfig()`).
A field left unset (None) takes its environment variable (moe/settings.py), else its default,
when the config is built: code > environment > default, and a variable changed after that
changes nothing. A `ranks_per_node=` argument (parallelize's, the dispatchers') takes
precedence over the field when the field was not given in code (both given and different: a
ValueError, moe/comm/topology.py).

The process-wide setters `set_hierarchical_threshold` / `set_cost_model` are deprecated aliases
of the fields `hierarchical_max_bytes` / `cost_model` (one release, DeprecationWarning): what
they set is read when a config is built, between the value given in code and the environment
(code > setter > environment > default), so a field given in ExchangeConfig wins.
"""

import warnings
from dataclasses import dataclass, field, fields

from moe import settings
from moe.comm.cost_model import CostModel, load_profile

DEFAULT_PIPELINE_MIN_BYTES = 2 << 20
# fields whose default is a value (the others default to None: the cost model decides, or
# detection)
_DEFAULTS = {"pipeline_min_bytes": DEFAULT_PIPELINE_MIN_BYTES, "overlap_cuda_stream": False}
# what the deprecated process-wide setters fixed (None: not set), read when a config is built
_SET_BY_SETTER: dict[str, object] = {"hierarchical_max_bytes": None, "cost_model": None}


@dataclass(frozen=True)
class ExchangeConfig:
    """Each field: None (the default) means not given, so MOE_... (read now), else the default.
    hierarchical_max_bytes: the per-rank buffer (bytes) up to which "auto" picks the
        hierarchical all-to-all (default None: the cost model's crossover).
        Environment: MOE_A2A_HIERARCHICAL_MAX_BYTES.
    pipeline_min_bytes: the smallest network message of a pipelined 2D exchange chunk (bytes;
        0 disables the pipelining; default 2 MiB). Environment: MOE_A2A_PIPELINE_MIN_BYTES.
    cost_profile: a JSON link profile (bench.alltoall --suite) for the cost model of "auto"
        (default None: NVLINK_IB on NCCL, none on gloo). Environment: MOE_A2A_COST_PROFILE.
    ranks_per_node: ranks per node of the hierarchical all-to-all (default None:
        LOCAL_WORLD_SIZE, else host names). Environment: MOE_RANKS_PER_NODE.
    overlap_cuda_stream: the overlapped dispatcher runs hierarchical exchanges on a side CUDA
        stream (not yet run on a GPU; default False: inline). Environment:
        MOE_OVERLAP_CUDA_STREAM.
    cost_model: the CostModel of "auto" (algorithm and overlap degree) given in code (default
        None: cost_profile's, else NVLINK_IB on NCCL, none on gloo); give it or cost_profile,
        not both. No environment variable (cost_profile is its file form)."""

    hierarchical_max_bytes: int | None = None
    pipeline_min_bytes: int | None = None
    cost_profile: str | None = None
    ranks_per_node: int | None = None
    overlap_cuda_stream: bool | None = None
    cost_model: CostModel | None = None
    # torchrun's LOCAL_WORLD_SIZE when the config was built (detection's first source)
    local_world_size: str | None = field(default=None, init=False, repr=False, compare=False)
    from_env: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    from_setter: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    profile_model: CostModel | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check()  # the values given in code
        from_setter = []
        for name, value in _SET_BY_SETTER.items():  # deprecated setters: below code
            if getattr(self, name) is None and value is not None:
                object.__setattr__(self, name, value)
                from_setter.append(name)
        object.__setattr__(self, "from_setter", tuple(from_setter))
        from_env = []
        for name in ENV_SETTINGS:
            if getattr(self, name) is None:
                value = settings.read(f"ExchangeConfig.{name}")
                object.__setattr__(self, name, _DEFAULTS.get(name) if value is None else value)
                from_env += [name] if value is not None else []
        object.__setattr__(self, "from_env", tuple(from_env))
        object.__setattr__(self, "local_world_size", settings.local_world_size())

    def model(self) -> CostModel | None:
        """The cost model given (cost_model, in code or by the deprecated set_cost_model),
        else the one in cost_profile, else None (the backend's default applies)."""
        return self.cost_model if self.cost_model is not None else self.profile()

    def profile(self) -> CostModel | None:
        """The cost model in cost_profile (None without one), read from the file once per
        config, the first time it is asked for (parallelize asks while the ranks agree), so a
        file changed later changes nothing; a failed read is raised again at the next ask."""
        if self.cost_profile and self.profile_model is None:
            object.__setattr__(self, "profile_model", load_profile(self.cost_profile))
        return self.profile_model

    def source(self, name: str) -> str:
        """Where field `name` came from: "code", "setter" (a deprecated process-wide setter),
        "env" (its variable) or "default"."""
        if name in self.from_env:
            return "env"
        if name in self.from_setter:
            return "setter"
        return "default" if getattr(self, name) == _DEFAULTS.get(name) else "code"

    def _check(self) -> None:
        for name in ("hierarchical_max_bytes", "pipeline_min_bytes", "ranks_per_node"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ExchangeConfig.{name} must be an int >= 0, got {value!r}")
        if self.ranks_per_node == 0:
            raise ValueError("ExchangeConfig.ranks_per_node must be >= 1, got 0")
        if self.cost_profile is not None and not isinstance(self.cost_profile, str):
            raise ValueError(
                f"ExchangeConfig.cost_profile must be a path, got {self.cost_profile!r}"
            )
        if self.overlap_cuda_stream is not None and not isinstance(self.overlap_cuda_stream, bool):
            raise ValueError(
                "ExchangeConfig.overlap_cuda_stream must be a bool, "
                f"got {self.overlap_cuda_stream!r}"
            )
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise ValueError(
                f"ExchangeConfig.cost_model must be a CostModel, got {type(self.cost_model).__name__}"
            )
        if self.cost_model is not None and self.cost_profile is not None:
            raise ValueError(
                "give ExchangeConfig.cost_model or ExchangeConfig.cost_profile, not both"
            )

    def record(self) -> dict[str, object]:
        """The fields as plain values, for the ranks' agreement check; not the cost model or
        the profile's path (ranks may read one profile from different paths: the model's
        values are compared where "auto" uses it, moe/parallel/config_check.py)."""
        skip = ("cost_profile", "cost_model")
        return {f"exchange.{name}": getattr(self, name) for name in SETTINGS if name not in skip}


SETTINGS = tuple(f.name for f in fields(ExchangeConfig) if f.init)  # the settings' fields
ENV_SETTINGS = tuple(name for name in SETTINGS if f"ExchangeConfig.{name}" in settings.ENV)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"moe.comm.{old} is deprecated (removed in the next release): give "
        f"ExchangeConfig({new}=...) to parallelize(exchange=) or the exchange instead",
        DeprecationWarning,
        stacklevel=3,
    )


def set_hierarchical_threshold(max_bytes: int | None) -> None:
    """Deprecated: ExchangeConfig(hierarchical_max_bytes=). Until removed, the default of that
    field for configs built from now on (a value given in code wins); None unsets it."""
    _deprecated("set_hierarchical_threshold", "hierarchical_max_bytes")
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
    ):
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    _SET_BY_SETTER["hierarchical_max_bytes"] = max_bytes


def set_cost_model(model: CostModel | None) -> None:
    """Deprecated: ExchangeConfig(cost_model=). Until removed, the default of that field for
    configs built from now on (a model or profile given in code wins); None unsets it."""
    _deprecated("set_cost_model", "cost_model")
    if model is not None and not isinstance(model, CostModel):
        raise ValueError(f"model must be a CostModel or None, got {type(model).__name__}")
    _SET_BY_SETTER["cost_model"] = model


def threshold_override() -> int | None:
    """What the deprecated set_hierarchical_threshold fixed (None: not set)."""
    return _SET_BY_SETTER["hierarchical_max_bytes"]


def env_var(name: str) -> str:
    """The environment variable that overrides ExchangeConfig.<name>."""
    return settings.ENV[f"ExchangeConfig.{name}"]


def resolved(config: "ExchangeConfig | None") -> ExchangeConfig:
    """`config`, or without one (a direct moe.comm call) an ExchangeConfig() built now."""
    if config is not None and not isinstance(config, ExchangeConfig):
        raise ValueError(f"exchange must be an ExchangeConfig, got {type(config).__name__}")
    return config if config is not None else ExchangeConfig()


def overlap_cuda_stream(config: ExchangeConfig | None) -> bool:
    """ExchangeConfig.overlap_cuda_stream of `config` (None: of ExchangeConfig())."""
    return bool(resolved(config).overlap_cuda_stream)
