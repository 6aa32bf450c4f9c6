"""parallelize(): expert parallelism over the mesh's "ep" dim and data parallelism on PyTorch's
FSDP2 engine, applied from outside a model that was written for one device.

Layout (docs/parallelism.md): routed experts are DTensors sharded Shard(0) over "ep", then
FSDP-sharded ("fsdp") or replicated ("ddp") over "dp"; every other parameter is sharded over
all ranks ("fsdp") or replicated ("ddp"). Every parameter keeps the single-process global
shape, so torch.distributed.checkpoint sees the same keys and shapes at any (dp, ep).
"""

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
from moe.dispatch import DISPATCHERS
from moe.dispatch.wire import wire_for
from moe.layer import moe_layers
from moe.parallel.config_check import check_config


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
def _broadcast_from_rank0(model: nn.Module) -> None:
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor, src=0)


def _wrapper(settings: dict):
    """(FSDP2's fully_shard or replicate, the keywords each call gets) for these settings."""
    mp_policy = settings["mp_policy"] or MixedPrecisionPolicy(reduce_dtype=settings["grad_dtype"])
    common = {
        "mp_policy": mp_policy,
        "offload_policy": settings["offload_policy"] or OffloadPolicy(),
    }
    if settings["data_parallel"] != "fsdp":
        return replicate, common
    return fully_shard, {**common, "reshard_after_forward": settings["reshard_after_forward"]}


def _build_dispatcher(settings: dict, group: dist.ProcessGroup, num_local: int, config):
    """One layer's dispatcher: the registered class settings["dispatcher"] built as
    cls(ep_group, num_local_experts, algorithm=, ranks_per_node=, exchange_config=), plus
    degree= when overlap= is given and wire= (the layer's RowWire, wire_for(config)) when it
    is not plain (ExpertParallelDispatcher's signature; check_config refused a class without
    it)."""
    overlap = settings["overlap"]
    row_wire = wire_for(config)
    wire = {} if row_wire.plain else {"wire": row_wire}
    return DISPATCHERS[settings["dispatcher"]](
        group,
        num_local,
        algorithm=settings["algorithm"],
        ranks_per_node=settings["ranks_per_node"],
        exchange_config=settings["exchange"],
        **({} if overlap is None else {"degree": overlap}),
        **wire,
    )


def dispatcher_name(dispatcher: str | None, overlap: int | str | None) -> str | None:
    """The registered dispatcher parallelize installs: `dispatcher`, else "overlap" when
    overlap is given, else "expert_parallel" (checked on every rank by check_config)."""
    if dispatcher is not None:
        return dispatcher
    return "expert_parallel" if overlap is None else "overlap"


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    data_parallel: Literal["ddp", "fsdp"] = "ddp",
    *,
    algorithm: str = "auto",
    ranks_per_node: int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool = True,
    blocks: list[nn.Module] | None = None,
    grad_dtype: torch.dtype | None = None,
    sync_params: bool = True,
    overlap: int | str | None = None,
    exchange: ExchangeConfig | None = None,
    dispatcher: str | None = None,
) -> nn.Module:
    """Shard every MoELayer's experts over mesh["ep"] (global expert e lives on ep rank
    e // (E / ep)), install the all-to-all exchange (flat, hierarchical or auto), and apply
    FSDP2 (data_parallel="fsdp": fully_shard) or FSDP2's replicate ("ddp") per unit:

      experts of each MoELayer   over mesh["dp"]   (gradient divided by the world size)
      each MoELayer (router, shared experts), each module of `blocks`, then the root model
                                 over all ranks     (mesh flattened to "dp_ep")

    so gradients are reduced by the time backward() returns and training equals
    single-process training on the global batch at any (dp, ep) and in any reduce dtype.

    Before anything else every rank's model and settings (these arguments, the all-to-all's
    ranks per node from the argument, MOE_RANKS_PER_NODE or LOCAL_WORLD_SIZE, and for "auto"
    the threshold and cost model) are compared: a difference, or a bad value on any rank, is
    the same ValueError on every rank naming it (moe/parallel/config_check.py).

    mp_policy / offload_policy / reshard_after_forward are FSDP2's (reshard only applies to
    "fsdp"); grad_dtype (e.g. torch.bfloat16) is a shorthand for
    MixedPrecisionPolicy(reduce_dtype=grad_dtype). sync_params broadcasts rank 0's parameters
    first, so every rank starts from one model. overlap (n chunks or "auto"; None = off)
    installs the OverlappedDispatcher, which hides the exchange behind the experts.
    exchange (moe.comm.ExchangeConfig; None: ExchangeConfig() from the environment, read now)
    is how the all-to-all runs: the dispatchers hold it and pass it to every exchange.
    dispatcher: a registered dispatcher's name (moe.dispatch.register_dispatcher; None:
    "overlap" with overlap=, else "expert_parallel"); how it is built: `_build_dispatcher`.
    """
    settings = {
        "data_parallel": data_parallel,
        "algorithm": algorithm,
        "ranks_per_node": ranks_per_node,
        "mp_policy": mp_policy,
        "grad_dtype": grad_dtype,
        "offload_policy": offload_policy,
        "reshard_after_forward": reshard_after_forward,
        "blocks": blocks,
        "sync_params": sync_params,
        "overlap": overlap,
        "exchange": exchange,
        "dispatcher": dispatcher_name(dispatcher, overlap),
    }
    # Validates the settings too: a bad value on one rank is the same error on every rank,
    # raised before any exchange.
    # environment overrides read once, agreed: the dispatchers get exactly this ExchangeConfig
    settings["exchange"] = check_config(model, mesh, settings)
    if sync_params:
        _broadcast_from_rank0(model)
    wrap, common = _wrapper(settings)
    # Gloo has neither AVG nor PREMUL_SUM: reduce with SUM, then divide (FSDP2's own switch).
    sum_only = dist.get_backend() != "nccl"
    all_ranks = mesh._flatten("dp_ep")  # dense parameters: sharded / replicated over the world
    for _, layer in moe_layers(model):
        local = _to_ep_dtensors(layer.experts, mesh["ep"])
        group = mesh.get_group("ep")
        layer.dispatcher = _build_dispatcher(settings, group, local, layer.config)
        layer.router.load_group = dist.group.WORLD  # observed load summed over all ranks
        layer.mesh = mesh
        wrap(layer.experts, mesh=mesh["dp"], **common)
        _divide_expert_grads(layer.experts, mesh["ep"].size(), sum_only)
    units = [layer for _, layer in moe_layers(model)] + list(blocks or []) + [model]
    for module in dict.fromkeys(units):  # once each: the model may itself be an MoELayer
        wrap(module, mesh=all_ranks, **common)
        module.set_force_sum_reduction_for_comms(sum_only)
    return model
