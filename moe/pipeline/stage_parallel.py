"""EP + FSDP2 on one pipeline stage, over the stage's own ("dp", "ep") mesh only, by
parallelize's own functions and settings (a ParallelConfig: one wrap and broadcast path).

Each unit of the stage (its `units()`: the children, or for a stage of Rooted children the
modules at their paths, each called in the forward) that holds an MoE layer is parallelized by
moe.parallel.parallelize on the stage's mesh (its MoE layers and the unit become FSDP2 units,
as parallelize(stage, blocks=...) would make them); every other unit with parameters and then
the stage itself are FSDP2 units over the stage's ranks (moe.parallel.parallelize.wrap_units).
A stage with no MoE layer never calls parallelize: it joins no MoE collective.

parallelize acts on the ranks of the mesh it is given only (its agreement check, its broadcast,
the routers' load group), so each stage checks and reduces over its own ranks. It is called
with sync_params=False: the pipeline broadcasts each whole stage, dense units included, from
the stage's first rank itself when PipelineConfig.sync_params (broadcast_from_first_rank).
"""

import warnings
from dataclasses import replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe.layer import moe_layers
from moe.parallel import ParallelConfig, parallelize
from moe.parallel.parallelize import wrap_units


def stage_config(parallel: ParallelConfig | None) -> ParallelConfig:
    """The stages' ParallelConfig: `parallel`, or ParallelConfig() for None. Its sync_params
    stays True (the default): PipelineConfig.sync_params decides the stages' broadcast. A dict
    of parallelize() keywords is still read, with a FutureWarning, for one release."""
    if parallel is None:
        return ParallelConfig()
    if isinstance(parallel, dict):  # deprecated: the dict form, until the next release
        warnings.warn(
            "Pipeline(parallel=<dict>) is deprecated: pass moe.parallel.ParallelConfig(...)",
            FutureWarning,
            stacklevel=3,
        )
        if "blocks" in parallel:
            raise ValueError("parallel: the pipeline sets blocks itself (the stages' units)")
        parallel = ParallelConfig(**parallel)
    if not isinstance(parallel, ParallelConfig):
        raise ValueError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
    if not parallel.sync_params:
        raise ValueError(
            "ParallelConfig.sync_params=False: the pipeline broadcasts each stage by "
            "PipelineConfig.sync_params (set that instead)"
        )
    return parallel


def parallelize_stage(stage: nn.Module, mesh: DeviceMesh, config: ParallelConfig) -> nn.Module:
    """EP + FSDP2 on `stage` (a PipelineStageModule or RootedStageModule) over `mesh` (the
    stage's ("dp", "ep") mesh) with `config`."""
    units = []
    for unit in stage.units():
        if moe_layers(unit):
            parallelize(unit, mesh, config=replace(config, sync_params=False))
        elif any(True for _ in unit.parameters()):
            units.append(unit)
    wrap_units([*units, stage], mesh, config)
    return stage
