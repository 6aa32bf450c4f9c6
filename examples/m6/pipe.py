"""--pp N: the M6 example on pipeline stages (moe.pipeline) over a ("pp", "dp", "ep") mesh.

PipelineRun holds this rank's stages of the M6 model (examples/m6/pipe_model.py) and does
what the single-process loop does around them, with the same math:
- a step: the pipeline's share of the global batch (its dp x ep coordinate's contiguous
  slice) in micro-batches of --micro-batch examples through PyTorch's schedule; each
  micro-batch's loss is its summed token cross-entropy x (pipelines / target tokens in the
  global batch) and its aux loss enters through moe.pipeline's aux mechanism (1/micro-batches);
- the tied embedding: the first stage's tok_embed.weight gets the sum of its gradient and the
  last stage's copy's (one all-reduce between the two ranks of each pipeline); the optimizer
  updates tok_embed.weight only and the copy is refreshed from it after each step and each
  load (one broadcast), so the two are always equal;
- checkpoints: this rank's tensors under the single-process names (examples/m6/pipe_ckpt.py),
  saved and loaded by moe.checkpoint's model-parts support at any (pp, dp, ep);
- gradient clipping by the global norm over every stage (the tied weight counted once);
- metrics: the same [loss, aux, dropped, routed] row as the single-process step, so the
  logged loss and aux are the global-batch means there too;
- evaluation: the whole model gathered onto every rank as a single-process M6Model (each
  stage's tensors, full, broadcast over "pp"), then the example's own evaluation, each rank
  a shard of the examples. Fine at the example's sizes; it holds the whole model per rank.

- the routing trace: one per stage, its layers under the single-process names
  (examples/m6/trace_io.py), drawn together into expert_load.png.

- --checkpointing: each block recomputed in backward (moe.memory.recompute_blocks on the
  stages' blocks; the recomputed forward counts no tokens a second time).

- --rebalance-every: moe.parallel.rebalance_experts per stage over its ranks (`rebalance`).

Not yet under --pp (refused in cli.py before any work): replicas (--spare-slots), the dense
baseline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor

import moe
import moe.memory
import moe.parallel
from examples.m6 import data as m6data
from examples.m6.pipe_model import TIED, pack_inputs, to_sequential
from examples.m6.setup import parallel_config
from moe.gating.balance import in_recomputation
from moe.pipeline import SCHEDULES, Pipeline, PipelineConfig, init_pipeline_mesh, plan_stages


def pipeline_config(args, per_pipeline: int) -> PipelineConfig:
    """The PipelineConfig of --schedule and --micro-batch (a ValueError names what is wrong)."""
    micro = args.micro_batch or default_micro_batch(args.pp, per_pipeline)
    given = args.pp_schedule or "1F1B"
    name = {key.lower(): key for key in SCHEDULES}.get(given.lower(), given)
    single = name in SCHEDULES and issubclass(SCHEDULES[name], PipelineScheduleSingle)
    return PipelineConfig(  # one stage per rank, or two (interleaved and V schedules)
        name,
        microbatches=per_pipeline // micro,
        stages_per_rank=1 if single else 2,
        split=args.split,
    )


def default_micro_batch(pp: int, per_pipeline: int) -> int:
    """2 pp micro-batches per step (every schedule's least, a small bubble), when they divide."""
    return max(per_pipeline // (2 * pp), 1)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class PipelineRun:
    """This rank's stages of `model` (built whole, the same on every rank) for --pp."""

    def __init__(self, model: nn.Module, cfg, args, world: int, device: torch.device):
        pp, ep = args.pp, args.ep or 1
        dp = args.dp or world // (pp * ep)
        self.width = dp * ep  # pipelines: the data-parallel ways
        self.coord = dist.get_rank() % self.width
        self.device, self.cfg, self.args = device, cfg, args
        self.mesh = init_pipeline_mesh(pp, dp, ep, device_type=device.type)
        self.config = pipeline_config(args, args.global_batch // self.width)
        seq, self.names = to_sequential(model, (cfg.channels, cfg.image_size, cfg.image_size))
        keep = _gathered(model)
        plan = plan_stages(seq, pp * self.config.stages_per_rank, None, self.config.split)
        if args.checkpointing:  # every block recomputed in backward, or this rank's first N
            rank = self.mesh.get_local_rank("pp")
            mine = [s for s, r in enumerate(self.config.stage_ranks(pp)) if r == rank]
            blocks = [n for s in mine for n in plan[s] if "blocks_" in n]
            first = None if args.checkpointing is True else args.checkpointing
            args.recomputed = moe.memory.recompute_blocks(seq, blocks[:first])
        children = dict(seq.named_children())
        self.stage_tensors = [  # (stage name, single-process name) of every stage's tensors
            [
                (f"{c}.{n}", self.names[f"{c}.{n}"])
                for c in names
                for n, _ in [*children[c].named_parameters(), *children[c].named_buffers()]
                if self.names[f"{c}.{n}"] in keep
            ]
            for names in plan
        ]
        self.scale = torch.ones((), dtype=torch.float64)  # W / global target tokens, per step
        self.pipe = Pipeline(seq, self.mesh, self.config, self._loss, parallel_config(args))
        self.modules = nn.ModuleList(self.pipe.modules)
        self._tie_group = self._tie_groups()
        self._counts = torch.zeros(2, dtype=torch.float64, device=device)  # dropped, routed
        for _, layer in moe.moe_layers(self.modules):
            layer.register_forward_hook(self._count)
        self._eval_model: nn.Module | None = None

    # -- the module interface the loop uses ---------------------------------------------
    def parameters(self):
        """What the optimizer updates: this rank's stage parameters but the head's copy of
        tok_embed.weight (refreshed from it after each step, `sync_tied`)."""
        return (p for name, p in self.pipe.named_parameters() if name != TIED)

    def checkpoint_module(self) -> nn.Module:
        """This rank's tensors under the single-process names (moe.checkpoint takes it)."""
        from examples.m6.pipe_ckpt import checkpoint_parts

        return checkpoint_parts(self)

    def train(self, mode: bool = True):
        self.modules.train(mode)
        return self

    # -- a step -----------------------------------------------------------------------------
    def _loss(self, logits_BLV: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(
            logits_BLV.float().flatten(0, 1),
            labels_BL.flatten(),
            ignore_index=m6data.IGNORE,
            reduction="sum",
        )
        return ce * self.scale

    def _count(self, layer, inputs, output) -> None:
        if layer.training and torch.is_grad_enabled() and not in_recomputation():
            s = layer.stats
            routed = s["routed_per_expert"].detach().to(self._counts).sum()
            self._counts += torch.stack([s["dropped"].detach().to(self._counts), routed])

    def step(self, data, enc, global_idx: torch.Tensor, rt) -> torch.Tensor:
        """Forward and backward of this pipeline's share of the step's global batch, the tied
        gradients summed; returns the step's metric row (examples/m6/metrics.StepMetrics)."""
        global_targets = (enc.labels_NL[global_idx] != m6data.IGNORE).sum()
        self.scale = self.width / global_targets.double()
        b = m6data.make_batch(data, enc, m6data.shard(global_idx, self.coord, self.width))
        b = b.to(self.device)
        self._counts.zero_()
        head = dict(self.pipe.named_parameters()).get(TIED)
        if head is not None:  # not the optimizer's: its gradient is cleared here
            head.grad = None
        with rt.autocast:
            _, losses = self.pipe.step(pack_inputs(b), b.labels_BL)
        aux = self.pipe.aux_loss().to(self._counts)
        loss = torch.stack(losses).sum().to(self._counts) if losses else self._counts.new_zeros(())
        self._sum_tied_grads()
        for module in self.pipe.modules:
            moe.update_router_biases(module)
        return torch.stack([loss / self.width, aux, *self._counts])

    def rebalance(self, opt) -> dict:
        """moe.parallel.rebalance_experts on each of this rank's stages with MoE layers, over
        the stage's ranks, layers named as one process names them: {stage index: report}."""
        from examples.m6.pipe_ckpt import stage_views

        return {s: moe.parallel.rebalance_experts(v, opt) for s, v in stage_views(self).items()}

    # -- the tied embedding -----------------------------------------------------------------
    def _tie_groups(self):
        """The group of this pipeline's first-stage and last-stage ranks (every rank creates
        every pipeline's group, in order); None where one rank holds both or neither."""
        first, last = self.pipe.stage_ranks[0], self.pipe.stage_ranks[-1]
        mine = None
        if first == last:
            return None
        for c in range(self.width):
            group = dist.new_group([first * self.width + c, last * self.width + c])
            if c == self.coord and (self.pipe.is_first or self.pipe.is_last):
                mine = group
        return mine

    def _tied(self) -> list[nn.Parameter]:
        named = dict(self.pipe.named_parameters())
        return [named[n] for n in ("embed.tok_embed.weight", TIED) if n in named]

    def _tied_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._tied()]

    @torch.no_grad()
    def sync_tied(self) -> None:
        """The head's copy := tok_embed.weight (after each optimizer step and each load)."""
        tied = [_local(p) for p in self._tied()]
        if len(tied) == 2:  # both stages on this rank (V schedules)
            tied[1].copy_(tied[0])
        elif tied and self._tie_group is not None:
            src = self.pipe.stage_ranks[0] * self.width + self.coord
            dist.broadcast(tied[0], src=src, group=self._tie_group)

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        grads = [_local(g) for g in self._tied_grads() if g is not None]
        if len(grads) == 2:  # both stages on this rank (V schedules)
            total = grads[0] + grads[1]
            for g in grads:
                g.copy_(total)
        elif grads and self._tie_group is not None:
            dist.all_reduce(grads[0], group=self._tie_group)

    # -- clipping ---------------------------------------------------------------------------
    @torch.no_grad()
    def clip(self, max_norm: float) -> None:
        """Scale every gradient by min(1, max_norm / global norm): each stage's sum of squares
        by DTensor's reductions over the stage's ranks (one per mesh), summed over "pp"."""
        if max_norm <= 0:
            return
        by_mesh: dict[int, list] = {}
        for name, p in self.pipe.named_parameters():
            if p.grad is not None and name != TIED:  # the tied weight once: its first copy
                by_mesh.setdefault(id(p.grad.device_mesh), []).append(p.grad)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for grads in by_mesh.values():
            norm = _full(torch.nn.utils.get_total_norm(grads, 2.0, foreach=True))
            total = total + norm.double().pow(2)
        dist.all_reduce(total, group=self.pipe.pp_group)
        coef = (max_norm / (total.sqrt().float() + 1e-6)).clamp(max=1.0)
        for p in self.pipe.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self) -> nn.Module:
        """The whole model as one single-process M6Model on every rank (collective): each
        stage's full tensors broadcast over "pp" from the rank holding them. The two copies of
        the tied embedding are compared (they must be equal)."""
        if self._eval_model is None:
            with torch.random.fork_rng(devices=[]):  # the training's random stream unchanged
                self._eval_model = self.cfg.build().to(self.device)
        targets = dict(_named_tensors(self._eval_model))
        local = {}
        for module in self.pipe.modules:
            local.update(_named_tensors(module))
        head_copy = None
        for s, owner in enumerate(self.pipe.stage_ranks):
            for name, single in self.stage_tensors[s]:
                out = targets[single]
                if name == TIED:
                    head_copy = out = torch.empty_like(out)
                if s in self.pipe.stage_indices:
                    out.copy_(_full(local[name]))
                if dist.get_world_size(self.pipe.pp_group) > 1:
                    dist.broadcast(out, group=self.pipe.pp_group, group_src=owner)
        if head_copy is not None and not torch.equal(head_copy, targets["tok_embed.weight"]):
            raise RuntimeError("--pp: the head's copy of tok_embed.weight differs from it")
        return self._eval_model


def _named_tensors(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def _gathered(model: nn.Module) -> set[str]:
    """The single-process names evaluation needs: parameters and buffers (the MoE layers' slot
    layouts too: after a rebalance the experts' rows are in the stage's placement)."""
    return {n for n, _ in _named_tensors(model)}


def for_eval(model):
    """What evaluation runs: the gathered single-process model under --pp, else `model`."""
    return model.gather() if isinstance(model, PipelineRun) else model


def pipeline_description(args, world: int) -> str:
    """'pipeline pp 2 (4 ranks), 1F1B, 4 micro-batches of 8' for the settings line."""
    width = max(world // args.pp, 1)
    config = pipeline_config(args, args.global_batch // width)
    micro = args.global_batch // width // config.microbatches
    return (
        f"pipeline pp {args.pp} ({world} ranks), {config.schedule}, "
        f"{config.microbatches} micro-batches of {micro}"
    )
