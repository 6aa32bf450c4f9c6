"""The MoE features on a pipeline's stages (issue 47): each acts on this rank's stage modules
with the stage's own ranks, as pp = 1 code acts on a whole model with the mesh's.

- `local_model(pipe)` (`Pipeline.local_model()`): this rank's stages' children in one
  nn.Module, under their names in the whole model (moved nothing: the same modules), for the
  core calls that take a model, as at pp = 1: `moe.update_router_biases`,
  `moe.reset_global_balance`, `moe.parallel.sum_replica_grads`. Every MoE layer on a rank
  (both stages of a rank under interleaved / V schedules) is on the rank's ("dp", "ep") mesh,
  so their collectives run over the stage's dp x ep ranks. `update_router_biases(pipe)`,
  `reset_global_balance(pipe)` and `sum_replica_grads(pipe)` here are deprecated aliases of
  those (one release).
- `record_routing(pipe)` / `replay_routing(pipe, routes)`: router record / replay on every
  rank, with or without MoE layers on it (a rank without records none and joins replay's
  agreement). Records are kept per layer, one per forward in the order the stage ran them:
  the schedules run a stage's forwards in micro-batch order, and a forward recomputed in
  backward replays its own record (moe.recompute_frame), so neither the micro-batch order
  of 1F1B nor virtual stages can mis-slice them. The stage-shape forwards of the first step
  neither record nor replay (`without_routes`).
- `routing_traces(pipe, path)`: one moe.RoutingTrace per local stage with MoE layers,
  reduced over the stage's ranks and written by its first rank; "{stage}" in `path` becomes
  the stage index.
- `rebalance_experts(pipe, optimizer)`: one report per stage, over the stage's ranks
  (moe.parallel.mesh.layers_group).
"""

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from moe.comm.consistency import all_gather_records
from moe.gating.balance import reset_global_balance as _reset_global_balance
from moe.layer import moe_layers
from moe.layer import update_router_biases as _update_router_biases
from moe.parallel.mesh import mesh_group
from moe.parallel.rebalance import RebalanceReport
from moe.parallel.rebalance import rebalance_experts as _rebalance_experts
from moe.parallel.replicas import sum_replica_grads as _sum_replica_grads
from moe.trace.replay import Routes, _rank_and_world_now
from moe.trace.replay import record_routing as _record_routing
from moe.trace.replay import replay_routing as _replay_routing
from moe.trace.routing_trace import RoutingTrace


class LocalStages(nn.Module):
    """This rank's stages' children, registered under their whole-model names (shared with
    the stage modules, not copied)."""

    def __init__(self, modules):
        super().__init__()
        for module in modules:
            for name, child in module.named_children():
                self.add_module(name, child)

    def forward(self, *args):
        raise RuntimeError("LocalStages is a view of a pipeline's stages; step the Pipeline")


def local_model(pipe) -> nn.Module:
    """This rank's stages as one module (parameter and layer names of the whole model)."""
    return LocalStages(pipe.modules)


def _deprecated(name: str, core: str) -> None:
    warnings.warn(
        f"moe.pipeline.features.{name}(pipe) is deprecated: call {core}(pipe.local_model())",
        FutureWarning,
        stacklevel=3,
    )


def update_router_biases(pipe) -> None:
    """Deprecated: moe.update_router_biases(pipe.local_model())."""
    _deprecated("update_router_biases", "moe.update_router_biases")
    _update_router_biases(local_model(pipe))


def reset_global_balance(pipe) -> None:
    """Deprecated: moe.reset_global_balance(pipe.local_model())."""
    _deprecated("reset_global_balance", "moe.reset_global_balance")
    _reset_global_balance(local_model(pipe))


@contextlib.contextmanager
def without_routes(module: nn.Module) -> Iterator[None]:
    """Inside: the MoE layers of `module` neither record nor replay routes (the pipeline's
    stage-shape forwards are not forwards of the training run)."""
    layers = [layer for _, layer in moe_layers(module)]
    saved = [(layer.route_recorder, layer.route_replay) for layer in layers]
    for layer in layers:
        layer.route_recorder = layer.route_replay = None
    try:
        yield
    finally:
        for layer, (recorder, replay) in zip(layers, saved):
            layer.route_recorder, layer.route_replay = recorder, replay


@contextlib.contextmanager
def record_routing(pipe) -> Iterator[Routes]:
    """moe.record_routing over this rank's stages; on a rank without MoE layers, empty Routes.
    Save with `routes.save("routes-{rank}.safetensors")` (one file per rank, as at pp = 1)."""
    model = local_model(pipe)
    if not moe_layers(model):
        rank, world = _rank_and_world_now()
        yield Routes({}, rank=rank, world=world)
        return
    with _record_routing(model) as routes:
        yield routes


@contextlib.contextmanager
def replay_routing(pipe, routes: Routes, weights: bool = False) -> Iterator[None]:
    """moe.replay_routing over this rank's stages (every rank enters it: one all-gather of
    every rank's check; a problem on any rank is the same ValueError on every rank). Run the
    steps, backward included, inside the block; the forwards taken are the recorded run's, in
    its order (each layer replays its records in turn, across steps)."""
    model = local_model(pipe)
    if moe_layers(model):
        with _replay_routing(model, routes, weights):
            yield
        return
    problem = None
    if routes.layers:
        problem = f"routes name {sorted(routes.layers)[:4]}, this rank's stages have no MoE layer"
    problems = [r["problem"] for r in all_gather_records({"problem": problem})]
    if problem is not None:
        raise ValueError(problem)
    first = next((r for r, p in enumerate(problems) if p is not None), None)
    if first is not None:
        raise ValueError(f"rank {first}: {problems[first]}")
    yield


def routing_traces(pipe, path: str | Path, every: int = 1, **kwargs) -> dict[int, RoutingTrace]:
    """{stage index: moe.RoutingTrace} for this rank's stages with MoE layers: the stage's
    layers (whole-model names), counts summed over the stage's ranks, the file (`path` with
    "{stage}" replaced by the stage index) written by the stage's first rank. Call
    `trace.step()` / `close()` on every rank of the stage. `kwargs`: RoutingTrace's."""
    if "{stage}" not in str(path):
        raise ValueError(
            f"routing_traces: path must hold '{{stage}}' (one file per stage), got {path!r}"
        )
    group = mesh_group(pipe.mesh["dp", "ep"])
    out = {}
    for s, module in zip(pipe.stage_indices, pipe.modules):
        if moe_layers(module):
            where = str(path).replace("{stage}", str(s))
            out[s] = RoutingTrace(LocalStages([module]), where, every, group=group, **kwargs)
    return out


def rebalance_experts(
    pipe, optimizer=None, *, min_gain: float = 0.05
) -> dict[int, RebalanceReport]:
    """moe.parallel.rebalance_experts on each of this rank's stages over the stage's ranks
    (after optimizer.step(), on every rank): {stage index: its report}."""
    return {
        s: _rebalance_experts(module, optimizer, min_gain=min_gain)
        for s, module in zip(pipe.stage_indices, pipe.modules)
    }


def sum_replica_grads(pipe) -> int:
    """Deprecated: moe.parallel.sum_replica_grads(pipe.local_model())."""
    _deprecated("sum_replica_grads", "moe.parallel.sum_replica_grads")
    return _sum_replica_grads(local_model(pipe))
