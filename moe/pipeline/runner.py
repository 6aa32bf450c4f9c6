"""Pipeline: a model split into stages over a ("pp", "dp", "ep") mesh, each stage EP + FSDP2
over its own ranks, stepped by PyTorch's pipelining engine (PipelineStage + a schedule).

Checked before any work: the mesh, the PipelineConfig, the stage plan and the parallel
settings, agreed across every rank (a bad value or a difference on any rank is the same
ValueError on every rank); each step's inputs likewise before the schedule runs.

The stages' activation shapes are found once, at the first step, by a forward of each stage
in turn (eval mode, no grad: no load is counted, no aux loss kept, no route recorded or
replayed) on the first micro-batch and then zeros of the previous stage's output shape,
and handed to PipelineStage as static
metadata: PyTorch's own inference would run an extra training forward and backward, on
uninitialised inputs for every stage but the first (a NaN there fails the router's finite
check on one rank).

Faults (issue 47): an exception on any rank inside a step (a stage's forward or backward,
the router's finite check, the loss, a dead peer) is one named error,
moe.pipeline.PipelineStepError, on every rank, within PipelineConfig.step_timeout; no rank
waits longer than step_timeout for another inside a step (Pipeline.step, moe.pipeline.faults).
The schedule runs on the thread that calls step(); a watcher thread only watches.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from moe.comm.consistency import raise_if_any_rank_failed
from moe.parallel import ParallelConfig
from moe.parallel.config_check import model_record, settings_record
from moe.parallel.parallelize import broadcast_from_first_rank
from moe.pipeline.config import PipelineConfig
from moe.pipeline.faults import StepGuard
from moe.pipeline.features import local_model, without_routes
from moe.pipeline.mesh import check_pipeline_mesh
from moe.pipeline.split import build_stage, param_count, plan_stages
from moe.pipeline.stage_parallel import parallelize_stage, stage_config


class Pipeline:
    """`model` (an nn.Sequential, identical on every rank) split by `config` over `mesh`
    (moe.pipeline.init_pipeline_mesh); this rank keeps its stages (`modules`, one per stage
    index in `stage_indices`), each parallelized over the rank's ("dp", "ep") mesh with
    `parallel` (a moe.parallel.ParallelConfig, as parallelize takes; None: its defaults).
    Every rank's model (its MoE layers' settings, every tensor's dtype and shape), mesh,
    config and parallel settings are compared across the whole pipeline, every stage, before
    any other communication: a difference is the same ValueError on every rank.
    loss_fn(output, target) -> one micro-batch's loss on the last stage (summed over the
    micro-batches unless config.scale_grads). The MoE features per stage (bias updates,
    router record / replay, routing traces, rebalance, replicas): moe.pipeline.features."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        config: PipelineConfig,
        loss_fn: Callable,
        parallel: ParallelConfig | None = None,
    ):
        problem, values = None, None
        try:
            parallel = stage_config(parallel)
            if not isinstance(config, PipelineConfig):
                raise ValueError(f"config must be a PipelineConfig, got {type(config).__name__}")
            check_pipeline_mesh(mesh)
            if mesh.size() != dist.get_world_size():
                raise ValueError(
                    f"the mesh has {mesh.size()} ranks, the world {dist.get_world_size()}"
                )
            pp = mesh.size(0)
            plan = plan_stages(model, pp * config.stages_per_rank, config.stages, config.split)
            config.check(pp, parallel.data_parallel, [param_count(c) for c in model.children()])
            if not callable(loss_fn):
                raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
            settings = settings_record(model, mesh["dp", "ep"], parallel, None)
            values = {
                **config.record(),
                "mesh": str(tuple(mesh.mesh.shape)),
                "plan": "|".join(",".join(names) for names in plan),
                **{f"parallel.{k}": v for k, v in settings.items()},
                **model_record(model),
            }
        except Exception as e:  # every rank learns of it, before any other communication
            problem = e
        raise_if_any_rank_failed(problem, error=ValueError, what="pipeline", values=values)
        self.config, self.parallel, self.loss_fn, self.mesh = config, parallel, loss_fn, mesh
        pp = mesh.size(0)
        self.stage_ranks = config.stage_ranks(pp)  # pp rank of each stage
        self.num_stages = len(self.stage_ranks)
        rank = mesh.get_local_rank("pp")
        self.stage_indices = [s for s, r in enumerate(self.stage_ranks) if r == rank]
        self.is_first = 0 in self.stage_indices
        self.is_last = self.num_stages - 1 in self.stage_indices
        # the pipeline's own groups (moe.pipeline.groups): the stages communicate over them
        self._guard = StepGuard(mesh, self.stage_indices, config.step_timeout)
        self.pp_group, stage_mesh = self._guard.pp_group, self._guard.mesh["dp", "ep"]
        self.modules = [build_stage(model, plan[s], config.aux_scale) for s in self.stage_indices]
        for module in self.modules:
            if config.sync_params:
                broadcast_from_first_rank(module, stage_mesh)
            parallelize_stage(module, stage_mesh, parallel)
        self._guard.watch(self.modules)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        self.schedule = None
        self._input_meta: tuple | None = None  # (shape, dtype) of one first-stage micro-batch

    def named_parameters(self):
        """This rank's stages' parameters, under their names in the whole model."""
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def local_model(self) -> nn.Module:
        """This rank's stages' children in one module, under their whole-model names (the same
        modules): for calls that take a model (moe.pipeline.features)."""
        return local_model(self)

    def step(self, x: torch.Tensor | None = None, target: torch.Tensor | None = None):
        """One step over `microbatches` micro-batches: x on the first stage, target on the last
        (ignored elsewhere). Gradients accumulate into .grad (zero them before). Returns
        (the last stage's merged output, its per-micro-batch losses); (None, None) elsewhere.

        Bad inputs are one ValueError on every rank before any work. An exception on any rank
        during the step (a stage's forward or backward, the router's finite check, the loss, a
        dead peer's closed connection) is one PipelineStepError on every rank, naming each
        failing rank, its stage and the original exception's type and message: the failing
        rank reports it through the agreement group's store and closes the pipeline's groups;
        a watcher thread on every other rank reads it (within a second; 0.05 s early in a
        step), closes them there too (a wait on them ends at once) and interrupts that rank's
        part. A rank that dies without a report ends the others' waits within
        config.step_timeout (its closed connections usually at once).
        No rank waits longer than step_timeout for another inside a step (ranks must call
        step within step_timeout of each other). The schedule runs on the calling thread, so
        grad mode, autocast, saved_tensors_hooks, dispatch modes and profilers entered around
        step() apply to the stages; the step ends with a barrier over every rank
        (moe.pipeline.faults). After a PipelineStepError this Pipeline cannot step again:
        build a new one on a new mesh."""
        guard = self._step_guard()
        m = self.config.microbatches
        problem = None
        try:
            if self.is_first:
                self._check_batch("x", x)
                meta = (tuple(x.tensor_split(m)[0].shape), str(x.dtype))
                if self._input_meta is not None and meta != self._input_meta:
                    raise ValueError(
                        f"a micro-batch of x is {meta}, the pipeline was built for "
                        f"{self._input_meta} (the stages' shapes are fixed at the first step)"
                    )
            if self.is_last:
                self._check_batch("target", target)
        except Exception as e:
            problem = e
        rows = [
            t.shape[0] if problem is None and use else -1
            for t, use in ((x, self.is_first), (target, self.is_last))
        ]
        guard.agree(problem, rows)
        if self.schedule is None:
            guard.call(lambda: self._build(x), keep=ValueError)
        for module in self.modules:
            module.aux_values.clear()
        losses: list | None = [] if self.is_last else None
        args = (x,) if self.is_first else ()
        output = guard.run(
            lambda: self.schedule.step(
                *args, target=target if self.is_last else None, losses=losses
            )
        )
        return (output, losses) if self.is_last else (None, None)

    def _step_guard(self) -> StepGuard:
        """The pipeline's StepGuard (moe.pipeline.faults), refusing a Pipeline that failed."""
        self._guard.refuse_if_failed()
        return self._guard

    def _check_batch(self, name: str, t) -> None:
        m = self.config.microbatches
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ValueError(
                f"stage {self.stage_indices} needs {name} (a batched tensor), got {t!r:.60}"
            )
        if t.shape[0] % m or t.shape[0] < m:
            raise ValueError(
                f"{name} has {t.shape[0]} rows, not a multiple of microbatches={m} (the stages "
                "exchange micro-batches of one fixed shape)"
            )

    def aux_loss(self) -> torch.Tensor:
        """The last step's aux loss of the whole model on this pipeline (every stage's MoE
        layers), the mean over micro-batches (float64), the same on each of its stages. Every
        rank calls it (one all-reduce over the "pp" group; no MoE collective)."""
        values = [v for module in self.modules for v in module.aux_values]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if values:
            total = torch.stack([v.double() for v in values]).sum().to(self.device)
        total = total / self.config.microbatches
        dist.all_reduce(total, group=self.pp_group)
        return total

    def _build(self, x: torch.Tensor | None) -> None:
        """Each stage's input and output shape, stage by stage (its rank broadcasts them over
        "pp"), then one PipelineStage per local stage and the schedule; an error on any stage
        is the same ValueError on every rank."""
        m = self.config.microbatches
        metas: list = [None] * self.num_stages
        problem = None
        for s, owner in enumerate(self.stage_ranks):
            box = [None]
            if s in self.stage_indices:
                try:
                    if s == 0:
                        inp = x.tensor_split(m)[0]
                    elif isinstance(metas[s - 1], str):
                        raise ValueError("the previous stage failed")
                    else:
                        shape, dtype = metas[s - 1]
                        inp = torch.zeros(shape, dtype=dtype, device=self.device)
                    box = [self._trial_forward(self.modules[self.stage_indices.index(s)], inp)]
                except Exception as e:  # noqa: BLE001 - reported on every rank below
                    problem = problem or e
                    box = [f"stage {s}: {type(e).__name__}: {e}"]
            dist.broadcast_object_list(box, group=self.pp_group, group_src=owner)
            metas[s] = box[0]
            if isinstance(box[0], str) and problem is None:
                problem = ValueError(box[0])
        raise_if_any_rank_failed(problem, error=ValueError, what="pipeline (stage shapes)")
        stages = []
        for s, module in zip(self.stage_indices, self.modules):
            if s == 0:
                self._input_meta = (tuple(x.tensor_split(m)[0].shape), str(x.dtype))
                inputs = x.tensor_split(m)[0]
            else:
                inputs = _empty(*metas[s - 1], self.device)
            stages.append(
                PipelineStage(
                    module,
                    s,
                    self.num_stages,
                    self.device,
                    input_args=inputs,
                    output_args=_empty(*metas[s], self.device),
                    group=self.pp_group,
                )
            )
        single = self.config.style == "single"
        self.schedule = self.config.schedule_class(
            stages[0] if single else stages,
            n_microbatches=m,
            loss_fn=self.loss_fn,
            scale_grads=self.config.scale_grads,
        )

    @torch.no_grad()
    def _trial_forward(self, module: nn.Module, inp: torch.Tensor) -> tuple:
        training = module.training
        module.eval()
        try:
            with without_routes(module):  # not a forward of the run: no record, no replay
                out = module(inp)
        finally:
            module.train(training)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"a stage must return one tensor, got {type(out).__name__}")
        return tuple(out.shape), out.dtype

    def checkpoint_module(self) -> nn.Module:
        """This rank's stages as one module for moe.checkpoint (save_checkpoint /
        load_checkpoint take the Pipeline itself): see moe.pipeline.checkpoint."""
        from moe.pipeline.checkpoint import stage_parts

        return stage_parts(self)


def _empty(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.requires_grad_(True) if t.is_floating_point() else t
