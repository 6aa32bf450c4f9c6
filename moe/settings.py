"""Process-wide settings outside any model's config, and the one module that reads the
environment (imports nothing from moe).

Each setting is a field of `Settings` (typed, with its default); an environment variable only
overrides a field, and is read here, at the moment the setting is used (tests and benchmarks
change some while a process runs). The README's "Environment variables" table lists them.
`LOCAL_WORLD_SIZE` (torchrun's) and `TRITON_INTERPRET` (Triton's) are read here too.
"""

import os
from dataclasses import dataclass, fields

_OFF = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Settings:
    """Settings of the kernels and the exchange that no config carries, with their defaults.

    triton_autotune: autotune the Triton kernels (False: one config per kernel, no
        benchmarking; the test suite's choice). Override: MOE_TRITON_AUTOTUNE=0.
    triton_tma: use the sm_90 tensor-memory-accelerator path of the ragged GEMM (opt-in until
        it has run on a GPU). Override: MOE_TRITON_TMA=1.
    overlap_cuda_stream: the overlapped dispatcher runs hierarchical exchanges on a side CUDA
        stream (not yet run on a GPU; off: they run inline). Override: MOE_OVERLAP_CUDA_STREAM=1.
    a2a_cost_profile: a JSON link profile (bench.alltoall --suite) for the all-to-all cost
        model of "auto". Override: MOE_A2A_COST_PROFILE=path.
    a2a_hierarchical_max_bytes: the per-rank buffer (bytes) up to which "auto" picks the
        hierarchical all-to-all (None: the cost model's crossover). Override:
        MOE_A2A_HIERARCHICAL_MAX_BYTES.
    a2a_pipeline_min_bytes: the smallest network message of a pipelined 2D exchange chunk
        (bytes; 0 disables the pipelining). Override: MOE_A2A_PIPELINE_MIN_BYTES.
    ranks_per_node: ranks per node of the hierarchical all-to-all (None: detected from
        LOCAL_WORLD_SIZE or host names), as text, validated where the group size is known.
        Override: MOE_RANKS_PER_NODE.
    """

    triton_autotune: bool = True
    triton_tma: bool = False
    overlap_cuda_stream: bool = False
    a2a_cost_profile: str | None = None
    a2a_hierarchical_max_bytes: str | None = None
    a2a_pipeline_min_bytes: str | None = None
    ranks_per_node: str | None = None


DEFAULT_PIPELINE_MIN_BYTES = 2 << 20  # Settings.a2a_pipeline_min_bytes when not set

# field -> the environment variable that overrides it
ENV = {
    "triton_autotune": "MOE_TRITON_AUTOTUNE",
    "triton_tma": "MOE_TRITON_TMA",
    "overlap_cuda_stream": "MOE_OVERLAP_CUDA_STREAM",
    "a2a_cost_profile": "MOE_A2A_COST_PROFILE",
    "a2a_hierarchical_max_bytes": "MOE_A2A_HIERARCHICAL_MAX_BYTES",
    "a2a_pipeline_min_bytes": "MOE_A2A_PIPELINE_MIN_BYTES",
    "ranks_per_node": "MOE_RANKS_PER_NODE",
}


def current() -> Settings:
    """The settings now: the defaults, overridden by the environment variables that are set
    (empty counts as unset)."""
    changes: dict[str, object] = {}
    for f in fields(Settings):
        raw = os.environ.get(ENV[f.name])
        if not raw:
            continue
        if f.name == "triton_autotune":
            changes[f.name] = raw.strip().lower() not in _OFF
        elif f.type is bool:
            changes[f.name] = raw == "1"
        else:
            changes[f.name] = raw
    return Settings(**changes)


def local_world_size() -> str | None:
    """torchrun's LOCAL_WORLD_SIZE (ranks on this node), as text; None when unset."""
    return os.environ.get("LOCAL_WORLD_SIZE")


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its CPU interpreter (for Tritons without
    `triton.knobs`; newer ones are asked directly)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
