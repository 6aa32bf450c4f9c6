"""Before any exchange, every rank of the mesh must have built the same MoE model and mesh and
asked for the same parallel settings.

One record per rank (every MoEConfig field of every MoE layer, every parameter's dtype and
shape, the mesh and its ranks, the layer count, the whole ParallelConfig with its
ExchangeConfig and the ranks per node it resolves to, the process's KernelConfig with what
they read from the environment, or this rank's own setup error) is all-gathered once over the
mesh's ranks (never the world: each pipeline stage checks its own mesh), so a mismatch or a
failure on one rank is the same clear ValueError on every rank of the mesh, naming the mesh,
instead of a hang, a gloo size error or "Connection closed by peer".
"""

from collections.abc import Callable
from dataclasses import asdict, fields, replace

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe.comm import alltoall
from moe.comm.consistency import Scalar, all_gather_records, describe_mismatch
from moe.comm.exchange_config import ExchangeConfig, resolved
from moe.comm.topology import ranks_per_node_setting
from moe.dispatch.dispatcher import DISPATCHERS
from moe.dispatch.wire import wire_for
from moe.kernels.kernel_config import kernel_config
from moe.layer import moe_layers
from moe.parallel.mesh import describe_mesh, mesh_group
from moe.parallel.parallel_config import ParallelConfig
from moe.slots.layout import check_spare_slots


def _describe(t) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _ranks_per_node(ranks_per_node: int | None, ep: int, exchange: ExchangeConfig) -> int | str:
    """The ranks per node the hierarchical exchange will use over the EP group, by the one
    function of moe.comm.topology but without its host-name collective: "hostname" when that
    is what decides (it is the same on every rank by construction). Invalid values raise
    ValueError naming their source."""
    setting = ranks_per_node_setting(ranks_per_node, ep, exchange)
    return "hostname" if setting is None else setting[0]


def exchange_record(
    algorithm: str,
    ranks_per_node: int | None,
    ep: int,
    exchange: ExchangeConfig | None = None,
    uses_cost_model: bool | None = None,
) -> dict[str, Scalar]:
    """What decides how the all-to-all runs: the algorithm and the ExchangeConfig (its
    environment overrides and deprecated setters were read when it was built: parallelize
    builds the one its dispatchers use); the ranks per node (the exchange's and the replica
    split's); where the cost model decides (algorithm "auto", and overlap "auto":
    uses_cost_model) every value of it (a loaded profile is validated here, on the rank that
    reads it)."""
    if algorithm not in alltoall.ALGORITHMS:
        raise ValueError(f"algorithm must be one of {alltoall.ALGORITHMS}, got {algorithm!r}")
    exchange = resolved(exchange)  # a bad environment override: a ValueError naming it
    record: dict[str, Scalar] = {"algorithm": algorithm, **exchange.record()}
    record["ranks_per_node"] = _ranks_per_node(ranks_per_node, ep, exchange)
    if algorithm == "auto" if uses_cost_model is None else uses_cost_model:
        model = alltoall.cost_model(dist.get_backend(), exchange)
        if model is None:
            record["cost_model"] = None
        else:
            record.update({f"cost_model.{k}": v for k, v in asdict(model).items()})
    return record


def settings_record(
    model: nn.Module, mesh: DeviceMesh, config: ParallelConfig, blocks: list[nn.Module] | None
) -> dict[str, Scalar]:
    """The ParallelConfig as a whole (ParallelConfig.record: every field), its exchange as it
    resolves over the mesh's "ep" dim, the process's KernelConfig and the blocks' names, as
    comparable scalars."""
    record: dict[str, Scalar] = {"data_parallel": config.data_parallel}
    uses_cost_model = "auto" in (config.algorithm, config.overlap)
    record.update(
        exchange_record(
            config.algorithm, config.ranks_per_node, mesh.size(1), config.exchange, uses_cost_model
        )
    )
    record.update(config.record())
    kernels = kernel_config()  # built from the environment now if no kernel has run yet
    record.update({f"kernel.{f.name}": repr(getattr(kernels, f.name)) for f in fields(kernels)})
    names = {id(m): n for n, m in model.named_modules()}
    if any(id(b) not in names for b in blocks or []):
        raise ValueError("blocks must be submodules of the model")
    record["blocks"] = ",".join(names[id(b)] for b in blocks or [])
    return record


def _check_wire_dispatcher(layer: str, config, dispatcher: str | None) -> None:
    """A layer whose rows travel in a row format (not plain) needs a dispatcher that declares
    `takes_wire` (else it would send the rows as they are: a silent change of format)."""
    cls = DISPATCHERS.get(dispatcher) if dispatcher else None
    wire = wire_for(config)
    if not wire.plain and cls is not None and not cls.takes_wire:
        formats = sorted({fmt.name for fmt in wire.formats if not fmt.plain})
        raise ValueError(
            f"{layer}: its rows travel in row format {', '.join(formats)}, but "
            f"dispatcher={dispatcher!r} ({cls.__name__}) takes no wire= argument (takes_wire "
            "is False: it would send them as they are)"
        )


def _config_fields(prefix: str, config) -> dict:
    """A dataclass config's fields as JSON scalars: a settings field (a dataclass or None,
    e.g. a feature's settings) as whether it is set, then its own fields one by one."""
    record = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if "settings" in f.metadata:
            record[f"{prefix}{f.name}"] = value is not None
            record.update(_config_fields(f"{prefix}{f.name}.", value) if value is not None else {})
        elif isinstance(value, tuple):  # (e.g. LoRAConfig.targets) compared as one string
            record[f"{prefix}{f.name}"] = ",".join(map(str, value))
        else:
            record[f"{prefix}{f.name}"] = value
    return record


def config_record(
    model: nn.Module,
    mesh: DeviceMesh,
    config: ParallelConfig,
    blocks: list[nn.Module] | None = None,
) -> dict:
    """What this rank must agree on with every other rank of the mesh; raises ValueError for
    a local problem."""
    names = tuple(mesh.mesh_dim_names or ())
    if names != ("dp", "ep"):
        raise ValueError(f"mesh dims must be ('dp', 'ep'), got {names}")
    dp, ep = mesh.size(0), mesh.size(1)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoELayer")
    record = {
        "world_size": dist.get_world_size(),
        "mesh": describe_mesh(mesh),
        "dp": dp,
        "ep": ep,
        **settings_record(model, mesh, config, blocks),
    }
    for name, layer in layers:
        c = layer.config
        if layer.experts.num_experts != layer.num_slots:
            raise ValueError(f"{name}: already parallelized")
        if c.num_experts % ep:
            raise ValueError(f"{name}: num_experts={c.num_experts} is not divisible by ep={ep}")
        check_spare_slots(name, layer.slot_layout().expert_of_slot, c, ep)  # any layout
        _check_wire_dispatcher(name, c, config.dispatcher_name)
    return {**record, **model_record(model)}


def model_record(model: nn.Module) -> dict[str, Scalar]:
    """The model as ranks must agree on it: its MoE layers (names and every MoEConfig field)
    and every parameter's and buffer's dtype and shape (parallelize's check over its mesh; the
    pipeline's over all of its ranks, before any stage communicates)."""
    layers = moe_layers(model)
    record: dict[str, Scalar] = {
        "moe_layers": len(layers),
        "moe_layer_names": ",".join(name for name, _ in layers),
    }
    for name, layer in layers:
        record.update(_config_fields(f"{name}.", layer.config))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        record[f"tensor {name}"] = _describe(tensor)
    return record


def check_config(
    model: nn.Module,
    mesh: DeviceMesh,
    config: ParallelConfig | Callable[[], ParallelConfig] | None = None,
    blocks: list[nn.Module] | None = None,
) -> ParallelConfig:
    """Raise the same ValueError on every rank of `mesh` if any of them failed to describe its
    model or settings, or they disagree; the message names the mesh, the field (a setting,
    layer.option, an environment variable or the tensor) and the ranks (numbered within the
    mesh). `config`: parallelize's ParallelConfig, or a function building it (so a bad keyword
    on one rank is this error on every rank). Returns the config that was agreed on, its
    exchange the ExchangeConfig given or one built from the environment now: the dispatchers
    must use this one, so no variable is read again. Only the mesh's ranks communicate."""
    group, where = mesh_group(mesh), describe_mesh(mesh)  # a bad mesh: raised on its own rank
    agreed = None
    try:
        agreed = config() if callable(config) else config or ParallelConfig()
        if not isinstance(agreed, ParallelConfig):
            raise ValueError(f"config must be a ParallelConfig, got {type(agreed).__name__}")
        agreed = replace(agreed, exchange=resolved(agreed.exchange))
        record = {"setup_error": None, **config_record(model, mesh, agreed, blocks)}
    except Exception as e:  # still join the exchange, so every rank learns of this error
        record = {"setup_error": f"{type(e).__name__}: {e}"}
    records = all_gather_records(record, group)
    failed = [(rank, r["setup_error"]) for rank, r in enumerate(records) if r.get("setup_error")]
    if failed:
        detail = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise ValueError(f"parallelize on {where}: setup failed on {len(failed)} rank(s): {detail}")
    message = describe_mismatch(records)
    if message is not None:
        raise ValueError(
            f"parallelize on {where}: the ranks differ in their model or settings: {message}"
        )
    assert agreed is not None
    return agreed
