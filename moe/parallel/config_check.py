"""Before any exchange, every rank must have built the same MoE model and mesh and asked for
the same parallel settings.

One record per rank (every MoEConfig field of every MoE layer, every parameter's dtype and
shape, the mesh, the layer count, the settings of parallelize(), its ExchangeConfig and the
process's KernelConfig with what they read from the environment, or this rank's own setup
error) is all-gathered once, so a mismatch or a
failure on one rank is the same clear ValueError on every rank instead of a hang, a gloo size
error or "Connection closed by peer".
"""

import inspect
from dataclasses import asdict, fields

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from moe.comm import alltoall
from moe.comm.consistency import Scalar, all_gather_records, describe_mismatch
from moe.comm.exchange_config import ExchangeConfig, resolved
from moe.comm.topology import ranks_per_node_setting
from moe.dispatch.dispatcher import DISPATCHERS
from moe.dispatch.overlap_option import validate_overlap
from moe.dispatch.wire import wire_for
from moe.kernels.kernel_config import kernel_config
from moe.layer import moe_layers
from moe.slots.layout import check_spare_slots

DATA_PARALLEL = ("ddp", "fsdp")


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
    algorithm: str, ranks_per_node: int | None, ep: int, exchange: ExchangeConfig | None = None
) -> dict[str, Scalar]:
    """What decides how the all-to-all runs: the algorithm and the ExchangeConfig (its
    environment overrides were read when it was built: parallelize builds the one its
    dispatchers use); for a 2D exchange the ranks per node; for "auto" the threshold override
    and every value of the cost model (a loaded profile is validated here, on the rank that
    reads it)."""
    if algorithm not in alltoall.ALGORITHMS:
        raise ValueError(f"algorithm must be one of {alltoall.ALGORITHMS}, got {algorithm!r}")
    exchange = resolved(exchange)  # a bad environment override: a ValueError naming it
    record: dict[str, Scalar] = {"algorithm": algorithm, **exchange.record()}
    if algorithm == "flat":
        return record
    record["ranks_per_node"] = _ranks_per_node(ranks_per_node, ep, exchange)
    if algorithm == "auto":
        record["set_hierarchical_threshold"] = alltoall.threshold_override()
        model = alltoall.cost_model(dist.get_backend(), exchange)
        if model is None:
            record["cost_model"] = None
        else:
            record.update({f"cost_model.{k}": v for k, v in asdict(model).items()})
    return record


def settings_record(model: nn.Module, mesh: DeviceMesh, settings: dict) -> dict[str, Scalar]:
    """parallelize()'s own settings, validated, as comparable scalars. Keys it does not know
    (options added later) are compared as they are."""
    s = dict(settings)
    data_parallel = s.pop("data_parallel", "ddp")
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be 'ddp' or 'fsdp', got {data_parallel!r}")
    mp_policy, grad_dtype = s.pop("mp_policy", None), s.pop("grad_dtype", None)
    if mp_policy is not None and grad_dtype is not None:
        raise ValueError("give grad_dtype or mp_policy, not both")
    mp_policy = mp_policy or MixedPrecisionPolicy(reduce_dtype=grad_dtype)
    record: dict[str, Scalar] = {"data_parallel": data_parallel}
    algorithm, ranks_per_node = s.pop("algorithm", "auto"), s.pop("ranks_per_node", None)
    exchange = s.pop("exchange", None)
    record.update(exchange_record(algorithm, ranks_per_node, mesh.size(1), exchange))
    for f in fields(mp_policy):
        value = getattr(mp_policy, f.name)
        record[f"mp_policy.{f.name}"] = value if isinstance(value, bool) else str(value)
    kernels = kernel_config()  # built from the environment now if no kernel has run yet
    record.update({f"kernel.{f.name}": repr(getattr(kernels, f.name)) for f in fields(kernels)})
    record["offload_policy"] = type(s.pop("offload_policy", None)).__name__
    blocks = s.pop("blocks", None) or []
    names = {id(m): n for n, m in model.named_modules()}
    if any(id(b) not in names for b in blocks):
        raise ValueError("blocks must be submodules of the model")
    record["blocks"] = ",".join(names[id(b)] for b in blocks)
    record["overlap"] = repr(validate_overlap(s.pop("overlap", None)))
    record["dispatcher"] = _dispatcher(s.pop("dispatcher", None), record["overlap"])
    for name, value in s.items():  # reshard_after_forward, sync_params, ...
        plain = value is None or isinstance(value, (bool, int, float, str))
        record[name] = value if plain else repr(value)
    return record


def _dispatcher(name: str | None, overlap: str) -> str | None:
    """parallelize(dispatcher=): a registered dispatcher, one that takes overlap= if given."""
    if name is None:
        return None
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher={name!r} is not one of {sorted(DISPATCHERS)}")
    if overlap != "None" and "degree" not in inspect.signature(DISPATCHERS[name]).parameters:
        raise ValueError(f"dispatcher={name!r} takes no overlap degree, got overlap={overlap}")
    return name


def _check_wire_dispatcher(layer: str, config, dispatcher: str | None) -> None:
    """A layer whose rows travel in a row format (not plain) needs a dispatcher that takes
    wire= (else it would send the rows as they are: a silent change of format)."""
    cls = DISPATCHERS.get(dispatcher) if dispatcher else None
    wire = wire_for(config)
    if not wire.plain and cls is not None and "wire" not in inspect.signature(cls).parameters:
        formats = sorted({fmt.name for fmt in wire.formats if not fmt.plain})
        raise ValueError(
            f"{layer}: its rows travel in row format {', '.join(formats)}, but "
            f"dispatcher={dispatcher!r} ({cls.__name__}) takes no wire= argument (it would "
            "send them as they are)"
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
        else:
            record[f"{prefix}{f.name}"] = value
    return record


def config_record(model: nn.Module, mesh: DeviceMesh, settings: dict | None = None) -> dict:
    """What this rank must agree on with every other; raises ValueError for a local problem."""
    names = tuple(mesh.mesh_dim_names or ())
    if names != ("dp", "ep"):
        raise ValueError(f"mesh dims must be ('dp', 'ep'), got {names}")
    dp, ep = mesh.size(0), mesh.size(1)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoELayer")
    record = {
        "world_size": dist.get_world_size(),
        "dp": dp,
        "ep": ep,
        **settings_record(model, mesh, settings or {}),
        "moe_layers": len(layers),
        "moe_layer_names": ",".join(name for name, _ in layers),
    }
    for name, layer in layers:
        c = layer.config
        if layer.experts.num_experts != layer.num_slots:
            raise ValueError(f"{name}: already parallelized")
        if c.num_experts % ep:
            raise ValueError(f"{name}: num_experts={c.num_experts} is not divisible by ep={ep}")
        check_spare_slots(name, layer.slot_layout().expert_of_slot, c, ep)  # any layout
        record.update(_config_fields(f"{name}.", c))
        _check_wire_dispatcher(name, c, record.get("dispatcher"))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        record[f"tensor {name}"] = _describe(tensor)
    return record


def check_config(
    model: nn.Module, mesh: DeviceMesh, settings: dict | None = None
) -> ExchangeConfig | None:
    """Raise the same ValueError on every rank if any rank failed to describe its model or
    settings, or the ranks disagree; the message names the field (a setting, layer.option, an
    environment variable or the tensor) and the ranks. `settings`: parallelize()'s arguments
    (data_parallel, algorithm, ranks_per_node, mp_policy, grad_dtype, ...). Returns the
    ExchangeConfig that was agreed on (settings["exchange"], or one built from the environment
    now): the dispatchers must use this one, so no variable is read again."""
    settings = dict(settings or {})
    try:
        settings["exchange"] = resolved(settings.get("exchange"))
        record = {"setup_error": None, **config_record(model, mesh, settings)}
    except Exception as e:  # still join the exchange, so every rank learns of this error
        record = {"setup_error": f"{type(e).__name__}: {e}"}
    records = all_gather_records(record)
    failed = [(rank, r["setup_error"]) for rank, r in enumerate(records) if r.get("setup_error")]
    if failed:
        detail = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise ValueError(f"parallelize: setup failed on {len(failed)} rank(s): {detail}")
    message = describe_mismatch(records)
    if message is not None:
        raise ValueError(f"parallelize: the ranks differ in their model or settings: {message}")
    return settings["exchange"]
