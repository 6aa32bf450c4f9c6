"""Before any exchange, every rank must have built the same MoE model and mesh.

One record per rank (every MoEConfig field of every MoE layer, every parameter's dtype and
shape, the mesh, the layer count, or this rank's own setup error) is all-gathered once, so a
mismatch or a failure on one rank is the same clear ValueError on every rank instead of a hang,
a gloo size error or "Connection closed by peer".
"""

from dataclasses import fields

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe.comm.consistency import all_gather_records, describe_mismatch
from moe.layer import moe_layers


def _describe(t) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def config_record(model: nn.Module, mesh: DeviceMesh, ranks_per_node: int | None) -> dict:
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
        "ranks_per_node": ranks_per_node,
        "moe_layers": len(layers),
        "moe_layer_names": ",".join(name for name, _ in layers),
    }
    for name, layer in layers:
        c = layer.config
        if layer.experts.num_experts != c.num_experts:
            raise ValueError(f"{name}: already parallelized")
        if c.num_experts % ep:
            raise ValueError(f"{name}: num_experts={c.num_experts} is not divisible by ep={ep}")
        for f in fields(c):
            record[f"{name}.{f.name}"] = getattr(c, f.name)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        record[f"tensor {name}"] = _describe(tensor)
    return record


def check_config(model: nn.Module, mesh: DeviceMesh, ranks_per_node: int | None = None) -> None:
    """Raise the same ValueError on every rank if any rank failed to describe its model or the
    ranks disagree; the message names the field (layer.option, or the tensor) and the ranks."""
    try:
        record = {"setup_error": None, **config_record(model, mesh, ranks_per_node)}
    except Exception as e:  # still join the exchange, so every rank learns of this error
        record = {"setup_error": f"{type(e).__name__}: {e}"}
    records = all_gather_records(record)
    failed = [(rank, r["setup_error"]) for rank, r in enumerate(records) if r.get("setup_error")]
    if failed:
        detail = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise ValueError(f"parallelize: setup failed on {len(failed)} rank(s): {detail}")
    message = describe_mismatch(records)
    if message is not None:
        raise ValueError(f"parallelize: the ranks built different models: {message}")
