"""ExchangeConfig: how the expert-parallel all-to-all runs, the declared home of its settings.

`moe.parallel.parallelize(..., exchange=ExchangeConfig(...))` hands it to the dispatchers,
which pass it to every exchange they plan. The environment variables of moe/settings.py
override its fields (read when the setting is used); `set_hierarchical_threshold`,
`set_cost_model` and a `ranks_per_node=` argument take precedence over both.
"""

from dataclasses import dataclass, fields

from moe import settings

DEFAULT_PIPELINE_MIN_BYTES = 2 << 20


@dataclass(frozen=True)
class ExchangeConfig:
    """hierarchical_max_bytes: the per-rank buffer (bytes) up to which "auto" picks the
        hierarchical all-to-all (None: the cost model's crossover).
        Override: MOE_A2A_HIERARCHICAL_MAX_BYTES.
    pipeline_min_bytes: the smallest network message of a pipelined 2D exchange chunk (bytes;
        0 disables the pipelining). Override: MOE_A2A_PIPELINE_MIN_BYTES.
    cost_profile: a JSON link profile (bench.alltoall --suite) for the cost model of "auto"
        (None: NVLINK_IB on NCCL, none on gloo). Override: MOE_A2A_COST_PROFILE.
    ranks_per_node: ranks per node of the hierarchical all-to-all (None: LOCAL_WORLD_SIZE,
        else host names). Override: MOE_RANKS_PER_NODE.
    overlap_cuda_stream: the overlapped dispatcher runs hierarchical exchanges on a side CUDA
        stream (not yet run on a GPU; False: inline). Override: MOE_OVERLAP_CUDA_STREAM=1."""

    hierarchical_max_bytes: int | None = None
    pipeline_min_bytes: int = DEFAULT_PIPELINE_MIN_BYTES
    cost_profile: str | None = None
    ranks_per_node: int | None = None
    overlap_cuda_stream: bool = False

    def __post_init__(self):
        for name in ("hierarchical_max_bytes", "pipeline_min_bytes", "ranks_per_node"):
            value = getattr(self, name)
            if value is None and name != "pipeline_min_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ExchangeConfig.{name} must be an int >= 0, got {value!r}")
        if self.ranks_per_node == 0:
            raise ValueError("ExchangeConfig.ranks_per_node must be >= 1, got 0")
        if self.cost_profile is not None and not isinstance(self.cost_profile, str):
            raise ValueError(
                f"ExchangeConfig.cost_profile must be a path, got {self.cost_profile!r}"
            )
        if not isinstance(self.overlap_cuda_stream, bool):
            raise ValueError(
                "ExchangeConfig.overlap_cuda_stream must be a bool, "
                f"got {self.overlap_cuda_stream!r}"
            )

    def record(self) -> dict[str, object]:
        """The fields as plain values, for the ranks' agreement check; not the profile's path
        (ranks may read one profile from different paths: its values are compared instead)."""
        return {
            f"exchange.{f.name}": getattr(self, f.name)
            for f in fields(self)
            if f.name != "cost_profile"
        }


DEFAULT = ExchangeConfig()


def env_var(name: str) -> str:
    """The environment variable that overrides ExchangeConfig.<name>."""
    return settings.ENV[f"ExchangeConfig.{name}"]


def override(name: str) -> str | None:
    """The text of the variable overriding ExchangeConfig.<name>, read now (None: unset)."""
    return settings.override(f"ExchangeConfig.{name}")


def overlap_cuda_stream(config: ExchangeConfig | None) -> bool:
    """ExchangeConfig.overlap_cuda_stream, unless MOE_OVERLAP_CUDA_STREAM overrides it."""
    value = settings.flag_override("ExchangeConfig.overlap_cuda_stream")
    return (config or DEFAULT).overlap_cuda_stream if value is None else value
