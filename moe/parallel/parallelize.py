"""parallelize(): expert parallelism over the mesh's "ep" dim and data parallelism on PyTorch's
FSDP2 engine, applied from outside a model that was written for one device.

Layout (docs/parallelism.md): routed experts are DTensors sharded Shard(0) over "ep", then
FSDP-sharded ("fsdp") or replicated ("ddp") over "dp"; every other parameter is sharded over
all of the mesh's ranks ("fsdp") or replicated ("ddp"). Every parameter keeps the
single-process global shape, so torch.distributed.checkpoint sees the same keys and shapes at
any (dp, ep). The settings: ParallelConfig (moe/parallel/parallel_config.py). Only the mesh's
ranks communicate (a pipeline stage's mesh is not the world).
"""

from dataclasses import fields
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

from moe.comm.exchange_config import ExchangeConfig
from moe.comm.topology import resolve_ranks_per_node
from moe.dispatch import DISPATCHERS
from moe.dispatch.wire import wire_for
from moe.layer import moe_layers
from moe.parallel.config_check import check_config
from moe.parallel.mesh import mesh_group
from moe.parallel.parallel_config import ParallelConfig


def _to_ep_dtensors(experts: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Replace each expert weight [E, ...] (identical on every rank after the broadcast) by a
    DTensor of global shape [E, ...] placed Shard(0) over "ep": this rank keeps its slice,
    no communication. Returns the number of local experts."""
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    local = experts.num_experts // ep
    first = ep_rank * local
    for pname, p in list(experts.named_parameters(recurse=False)):
        shard = p.detach()[first : first + local].clone()
        dt = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, pname, nn.Parameter(dt, requires_grad=p.requires_grad))
    experts.expert_offset, experts.num_local_experts = first, local
    return local


class _DivideBy:
    """FSDP2 all-reduce hook: divide the reduced gradient shard in place (no communication)."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __call__(self, grad: torch.Tensor) -> None:
        grad.div_(self.factor)


def _divide_expert_grads(experts: nn.Module, ep: int, sum_only: bool) -> None:
    """Make the experts' reduced gradient sum / world (= dp * ep) in every reduce dtype.

    Each expert's local gradient already sums the tokens of its whole EP group, so the mean
    over dp that FSDP2 computes by default is ep times too large. FSDP2's default (no custom
    divide factor) is right in each of its branches (AVG / PREMUL_SUM for float32 and bf16,
    pre- and post-division for float64 and float16, SUM then divide on gloo); a custom factor
    is not: with a reduce-scatter over one rank (dp=1, and always under replicate) it is
    applied on top of the pre/post division, so float64 and float16 came out 1/world too
    small. So FSDP2 keeps its default mean over dp and the remaining 1/ep is one in-place
    division of the reduced shard, after FSDP2's reduction whatever branch it took.
    """
    experts.set_force_sum_reduction_for_comms(sum_only)
    if ep > 1:
        experts.set_all_reduce_hook(_DivideBy(ep))


@torch.no_grad()
def broadcast_from_first_rank(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter and buffer of the mesh's first rank (not world rank 0) on every rank
    of the mesh (parallelize's sync_params; each pipeline stage's, over its own mesh)."""
    group = mesh_group(mesh)
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor, group=group, group_src=0)


def _wrapper(config: ParallelConfig):
    """(FSDP2's fully_shard or replicate, the keywords each call gets) for this config."""
    common = {
        "mp_policy": config.mixed_precision,
        "offload_policy": config.offload_policy or OffloadPolicy(),
    }
    if config.data_parallel != "fsdp":
        return replicate, common
    return fully_shard, {**common, "reshard_after_forward": config.reshard_after_forward}


def wrap_units(units: list[nn.Module], mesh: DeviceMesh, config: ParallelConfig) -> None:
    """FSDP2 (fully_shard for "fsdp", replicate for "ddp") on each module of `units`, once
    each and in order, over all of `mesh`'s ranks: the dense units of parallelize and of a
    pipeline stage. Gloo has neither AVG nor PREMUL_SUM: reduce with SUM, then divide
    (FSDP2's own switch)."""
    wrap, common = _wrapper(config)
    sum_only = dist.get_backend() != "nccl"
    flat = mesh._flatten("_".join(mesh.mesh_dim_names))
    for module in dict.fromkeys(units):  # once each: the model may itself be an MoELayer
        wrap(module, mesh=flat, **common)
        module.set_force_sum_reduction_for_comms(sum_only)


def _build_dispatcher(
    config: ParallelConfig,
    group: dist.ProcessGroup,
    num_local: int,
    ranks_per_node: int,
    moe_config,
):
    """One layer's dispatcher, by the constructor contract (docs/architecture.md, "A
    dispatcher"): the registered class config.dispatcher_name built as
    cls(ep_group, num_local_experts, algorithm=, ranks_per_node= (resolved), exchange_config=),
    plus degree= when overlap= is given (a class declaring `overlaps`) and wire= (the layer's
    RowWire, wire_for(moe_config)) when it is not plain (a class declaring `takes_wire`;
    check_config refused any other)."""
    row_wire = wire_for(moe_config)
    wire = {} if row_wire.plain else {"wire": row_wire}
    return DISPATCHERS[config.dispatcher_name](
        group,
        num_local,
        algorithm=config.algorithm,
        ranks_per_node=ranks_per_node,
        exchange_config=config.exchange,
        **({} if config.overlap is None else {"degree": config.overlap}),
        **wire,
    )


def _config(config: ParallelConfig | None, keywords: dict) -> ParallelConfig:
    """`config`, or one built from parallelize's keywords (those not None), not both."""
    names = [f.name for f in fields(ParallelConfig)]
    given = {k: keywords[k] for k in names if keywords.get(k) is not None}
    if config is not None and given:
        raise ValueError(f"give config= or keywords, not both (got config and {sorted(given)})")
    return config if config is not None else ParallelConfig(**given)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    data_parallel: Literal["ddp", "fsdp"] | None = None,
    *,
    config: ParallelConfig | None = None,
    blocks: list[nn.Module] | None = None,
    algorithm: str | None = None,
    ranks_per_node: int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | None = None,
    grad_dtype: torch.dtype | None = None,
    sync_params: bool | None = None,
    overlap: int | str | None = None,
    exchange: ExchangeConfig | None = None,
    dispatcher: str | None = None,
) -> nn.Module:
    """Shard every MoELayer's experts over mesh["ep"] (global expert e lives on ep rank
    e // (E / ep)), install the all-to-all exchange (flat, hierarchical or auto), and apply
    FSDP2 (data_parallel="fsdp": fully_shard) or FSDP2's replicate ("ddp") per unit:

      experts of each MoELayer   over mesh["dp"]   (gradient divided by the mesh's size)
      each MoELayer (router, shared experts), each module of `blocks`, then the root model
                                 over the mesh's ranks (mesh flattened to "dp_ep")

    so gradients are reduced by the time backward() returns and training equals
    single-process training on the mesh's global batch at any (dp, ep) and reduce dtype.
    Only the ranks of `mesh` communicate, never the world: a pipeline stage passes its own
    mesh["dp", "ep"], and each stage keeps its own weights and settings.

    The settings are a ParallelConfig (moe/parallel/parallel_config.py: each field's meaning
    and check): `config=`, or its fields as keywords (data_parallel positional), not both.
    blocks: submodules of the model wrapped as their own FSDP2 units (agreed by name).
    Before anything else every rank's model and whole ParallelConfig (with its ExchangeConfig,
    the ranks per node it resolves to and for "auto" the cost model) are compared over the
    mesh: a difference, or a bad value on any rank, is the same ValueError on every rank of the
    mesh naming it and the mesh (moe/parallel/config_check.py). Ranks per node are then
    resolved once (moe.comm.topology.resolve_ranks_per_node) and handed to every dispatcher,
    which passes them to every exchange; the replica split reads the same value.
    """
    keywords = dict(locals())  # the ParallelConfig fields given as keywords (None: not given)
    # built inside the check (a bad value is every rank's error); the config as agreed: its
    # ExchangeConfig built now if none was given, so the dispatchers get exactly that one
    config = check_config(model, mesh, partial(_config, config, keywords), blocks)
    if config.sync_params:
        broadcast_from_first_rank(model, mesh)
    wrap, common = _wrapper(config)
    sum_only = dist.get_backend() != "nccl"  # as wrap_units
    all_ranks = mesh._flatten("dp_ep")  # dense parameters: sharded / replicated over the mesh
    group = mesh.get_group("ep")
    per_node = resolve_ranks_per_node(group, config.ranks_per_node, config.exchange)
    for _, layer in moe_layers(model):
        local = _to_ep_dtensors(layer.experts, mesh["ep"])
        layer.dispatcher = _build_dispatcher(config, group, local, per_node, layer.config)
        layer.router.load_group = all_ranks.get_group()  # observed load summed over the mesh
        layer.mesh = mesh
        wrap(layer.experts, mesh=mesh["dp"], **common)
        _divide_expert_grads(layer.experts, mesh["ep"].size(), sum_only)
    wrap_units(
        [layer for _, layer in moe_layers(model)] + list(blocks or []) + [model], mesh, config
    )
    return model
