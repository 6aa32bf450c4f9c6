"""ParallelConfig: the declared home of every setting `parallelize` takes.

`parallelize(model, mesh, config=ParallelConfig(...))`, or the same fields as keywords
(`parallelize(model, mesh, "fsdp", overlap=2)` builds one). Each field is validated when the
config is built (a ValueError naming the field), and the whole config is agreed across the
ranks of the mesh by moe/parallel/config_check.py (`ParallelConfig.record`: every field, so a
field added here is compared with no other change). Pipeline stages add one field here.

`blocks` is not a field: it names modules of one model (a list of submodules), where a
ParallelConfig is a model-free value that can be built once and reused; it stays a keyword
of parallelize and is agreed across ranks by the modules' names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from moe.comm.alltoall import ALGORITHMS
from moe.comm.exchange_config import ExchangeConfig
from moe.dispatch.dispatcher import DISPATCHERS
from moe.dispatch.overlap_option import validate_overlap

DATA_PARALLEL = ("ddp", "fsdp")


@dataclass(frozen=True)
class ParallelConfig:
    """How parallelize lays a model out over a ("dp", "ep") mesh.

    data_parallel: "ddp" (FSDP2's replicate) or "fsdp" (fully_shard) over "dp".
    algorithm: the expert all-to-all, "flat", "hierarchical" or "auto" (moe.comm).
    ranks_per_node: ranks per node of the EP group for the hierarchical exchange and the
        replica split (None: ExchangeConfig.ranks_per_node, MOE_RANKS_PER_NODE,
        LOCAL_WORLD_SIZE, host names; moe/comm/topology.py); resolved once by parallelize.
    mp_policy / offload_policy / reshard_after_forward: FSDP2's (reshard only for "fsdp").
    grad_dtype: shorthand for MixedPrecisionPolicy(reduce_dtype=grad_dtype); not with mp_policy.
    sync_params: broadcast the parameters and buffers of the mesh's first rank to its other
        ranks first, so every rank of the mesh starts from one model.
    overlap: None (off), an int >= 1 or "auto": the overlapped dispatcher's degree.
    exchange: the all-to-all's ExchangeConfig (None: ExchangeConfig() built by parallelize).
    dispatcher: a registered dispatcher (None: "overlap" with overlap=, else "expert_parallel").
    """

    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    algorithm: str = "auto"
    ranks_per_node: int | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    reshard_after_forward: bool | int = True
    grad_dtype: torch.dtype | None = None
    sync_params: bool = True
    overlap: int | str | None = None
    exchange: ExchangeConfig | None = None
    dispatcher: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            _CHECKS.get(f.name, lambda v: None)(getattr(self, f.name))
        if self.mp_policy is not None and self.grad_dtype is not None:
            raise ValueError("ParallelConfig: give grad_dtype or mp_policy, not both")
        cls = DISPATCHERS[self.dispatcher_name]
        if self.overlap is not None and not cls.overlaps:
            raise ValueError(
                f"ParallelConfig.dispatcher={self.dispatcher_name!r} takes no overlap degree "
                f"({cls.__name__}.overlaps is False), got overlap={self.overlap!r}"
            )

    @property
    def dispatcher_name(self) -> str:
        """The registered dispatcher parallelize installs: `dispatcher`, else "overlap" when
        overlap is given, else "expert_parallel"."""
        if self.dispatcher is not None:
            return self.dispatcher
        return "expert_parallel" if self.overlap is None else "overlap"

    @property
    def mixed_precision(self) -> MixedPrecisionPolicy:
        """FSDP2's policy: mp_policy, else one reducing in grad_dtype."""
        return self.mp_policy or MixedPrecisionPolicy(reduce_dtype=self.grad_dtype)

    def record(self) -> dict[str, object]:
        """Every field as comparable JSON scalars, for the ranks' agreement check. The
        ExchangeConfig and ranks_per_node are recorded as the exchange resolves them (by
        config_check, which knows the EP group); a field without a recorder here is compared
        as itself when plain, else by repr."""
        record: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("exchange", "ranks_per_node", "grad_dtype"):
                continue  # exchange_record / mp_policy.reduce_dtype
            if f.name == "mp_policy":
                for g in fields(self.mixed_precision):
                    v = getattr(self.mixed_precision, g.name)
                    record[f"mp_policy.{g.name}"] = v if isinstance(v, bool) else str(v)
            elif f.name == "offload_policy":
                record[f.name] = type(value).__name__  # OffloadPolicy() when None: the same
            elif f.name == "overlap":
                record[f.name] = repr(value)
            elif f.name == "dispatcher":
                record[f.name] = self.dispatcher_name
            else:
                plain = value is None or isinstance(value, (bool, int, float, str))
                record[f.name] = value if plain else repr(value)
        return record


def _check_data_parallel(value) -> None:
    if value not in DATA_PARALLEL:
        raise ValueError(f"ParallelConfig.data_parallel must be 'ddp' or 'fsdp', got {value!r}")


def _check_algorithm(value) -> None:
    if value not in ALGORITHMS:
        raise ValueError(f"ParallelConfig.algorithm must be one of {ALGORITHMS}, got {value!r}")


def _check_ranks_per_node(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"ParallelConfig.ranks_per_node must be an int >= 1, got {value!r}")


def _instance_of(name: str, cls: type):
    def check(value) -> None:
        if value is not None and not isinstance(value, cls):
            raise ValueError(
                f"ParallelConfig.{name} must be None or of type {cls.__name__}, "
                f"got {type(value).__name__}"
            )

    return check


def _check_reshard(value) -> None:
    if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 1):
        raise ValueError(
            f"ParallelConfig.reshard_after_forward must be a bool or an int >= 1, got {value!r}"
        )


def _check_sync_params(value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"ParallelConfig.sync_params must be a bool, got {value!r}")


def _check_overlap(value) -> None:
    try:
        validate_overlap(value)
    except ValueError as e:
        raise ValueError(f"ParallelConfig.{e}") from None


def _check_dispatcher(value) -> None:
    if value is not None and value not in DISPATCHERS:
        raise ValueError(f"ParallelConfig.dispatcher={value!r} is not one of {sorted(DISPATCHERS)}")


_CHECKS = {
    "data_parallel": _check_data_parallel,
    "algorithm": _check_algorithm,
    "ranks_per_node": _check_ranks_per_node,
    "mp_policy": _instance_of("mp_policy", MixedPrecisionPolicy),
    "offload_policy": _instance_of("offload_policy", OffloadPolicy),
    "reshard_after_forward": _check_reshard,
    "grad_dtype": _instance_of("grad_dtype", torch.dtype),
    "sync_params": _check_sync_params,
    "overlap": _check_overlap,
    "exchange": _instance_of("exchange", ExchangeConfig),
    "dispatcher": _check_dispatcher,
}
