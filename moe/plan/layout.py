"""Layout: one point of the planner's search (how a run is parallelized and what it trades
memory for), as the typed values the library takes (`parallel`: a ParallelConfig, `pipeline`:
a PipelineConfig, `moe_settings`: MoEConfig fields), and the code and M6 flags rendered from
those values, so what is printed is what was predicted."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass

from moe.parallel.parallel_config import ParallelConfig
from moe.pipeline.config import PipelineConfig

RECOMPUTE = ("none", "moe", "full")  # or "blocks:N": the N first blocks of each rank recomputed
OFFLOAD = (None, "optimizer", "all")


@dataclass(frozen=True)
class Layout:
    """pp x dp x ep devices; `schedule`, `stages_per_rank` and `split` when pp > 1 ("none" / 1
    at pp = 1); `microbatches` of `micro_batch_seqs` sequences per pipeline and step (at pp = 1:
    gradient accumulation); the rest as moe.parallel / moe.memory / MoEConfig name them. The
    typed values: `parallel`, `pipeline`, `moe_settings` (built from these fields, checked by
    their own constructors)."""

    pp: int
    dp: int
    ep: int
    data_parallel: str = "fsdp"
    schedule: str = "none"
    stages_per_rank: int = 1
    microbatches: int = 1
    micro_batch_seqs: int = 1
    recompute: str = "none"
    offload: str | None = None
    groups: int = 1
    capacity_factor: float | None = None
    exchange: str = "flat"
    overlap: int = 1
    fp8_dispatch: bool = False
    fp8_experts: bool = False
    replicas: int = 0  # MoEConfig.spare_slots: expert slots for copies of hot experts, per layer
    split: str = "children"  # PipelineConfig.split: how the pipeline cuts the stack

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep

    def short(self) -> str:
        """One line: pp x dp x ep, schedule, micro-batches and what differs from the defaults."""
        parts = [f"pp{self.pp} dp{self.dp} ep{self.ep} {self.data_parallel}"]
        if self.pp > 1:
            v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"{self.schedule}{v}")
        parts.append(f"m{self.microbatches}x{self.micro_batch_seqs}")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.offload:
            parts.append(f"offload={self.offload}")
        if self.groups > 1:
            parts.append(f"groups={self.groups}")
        if self.ep > 1:
            parts.append(self.exchange + (f" overlap{self.overlap}" if self.overlap > 1 else ""))
        if self.fp8_dispatch or self.fp8_experts:
            parts.append("fp8:" + "+".join(n for n, on in (("dispatch", self.fp8_dispatch),
                                                          ("experts", self.fp8_experts)) if on))  # fmt: skip
        if self.replicas:
            parts.append(f"replicas={self.replicas}")
        if self.capacity_factor:
            parts.append(f"cf={self.capacity_factor:g}")
        return " ".join(parts)

    @property
    def parallel(self) -> ParallelConfig:
        """The ParallelConfig that parallelize (pp = 1) or each pipeline stage takes."""
        return ParallelConfig(
            self.data_parallel,
            self.exchange if self.ep > 1 else "flat",
            overlap=self.overlap if self.overlap > 1 else None,
        )

    @property
    def pipeline(self) -> PipelineConfig | None:
        """The PipelineConfig of the pipeline (None at pp = 1)."""
        if self.pp == 1:
            return None
        return PipelineConfig(
            self.schedule,
            microbatches=self.microbatches,
            stages_per_rank=self.stages_per_rank,
            split=self.split,
        )

    @property
    def moe_settings(self) -> dict:
        """The MoEConfig fields this layout sets on every MoE layer (the rest as the model has
        them): capacity_factor, recompute (MoE-only recompute), fp8 (an FP8Config),
        spare_slots."""
        out: dict = {}
        if self.capacity_factor:
            out["capacity_factor"] = self.capacity_factor
        if self.recompute == "moe":
            out["recompute"] = True
        if self.fp8_dispatch or self.fp8_experts:
            from moe.fp8 import FP8Config  # loaded only when a layout uses it

            out["fp8"] = FP8Config(dispatch=self.fp8_dispatch, experts=self.fp8_experts)
        if self.replicas:
            out["spare_slots"] = self.replicas
        return out

    @property
    def recompute_blocks(self) -> int | None:
        """Whole blocks recomputed per pp rank (its first ones): None none, -1 all."""
        if self.recompute == "full":
            return -1
        if self.recompute.startswith("blocks:"):
            return int(self.recompute.split(":")[1])
        return None

    def record(self) -> dict:
        return asdict(self)

    def code(self) -> str:
        """The calls that apply this layout with moe's public names, rendered from the typed
        values: a torchrun script pastes them after building `model` with
        MoEConfig(..., **moe_settings) (and, at pp > 1, defining `loss_fn`)."""
        settings = self.moe_settings
        lines = ["import moe.memory, moe.parallel" + (", moe.pipeline" if self.pp > 1 else "")]
        lines.append("from moe.parallel import ParallelConfig")
        if self.pp > 1:
            lines.append("from moe.pipeline import PipelineConfig")
        if "fp8" in settings:
            lines.append("from moe.fp8 import FP8Config")
        values = ", ".join(f"{k!r}: {render(v)}" for k, v in settings.items())
        lines.append(f"moe_settings = {{{values}}}  # the MoE layers' MoEConfig fields")
        blocks = self.recompute_blocks
        if self.pp == 1:
            if blocks is not None:
                names = "" if blocks < 0 else f", moe.memory.find_repeated_blocks(model)[:{blocks}]"
                lines.append(f"moe.memory.recompute_blocks(model{names})")
            lines += [
                f"mesh = moe.parallel.init_mesh(dp={self.dp}, ep={self.ep})",
                f"moe.parallel.parallelize(model, mesh, config={render(self.parallel)})",
                f"# {self.microbatches} micro-batches of {self.micro_batch_seqs} sequences a step",
                "params = list(model.parameters())",
            ]
        else:
            lines += [
                f"mesh = moe.pipeline.init_pipeline_mesh(pp={self.pp}, dp={self.dp}, ep={self.ep})",
                f"config = {render(self.pipeline)}",
                f"pipe = moe.pipeline.Pipeline(model, mesh, config, loss_fn, "
                f"parallel={render(self.parallel)})",
                f"# micro-batches of {self.micro_batch_seqs} sequences (pipe.step takes "
                f"{self.microbatches * self.micro_batch_seqs} a step)",
            ]
            if blocks is not None:
                lines += [
                    "stack = [name for name, _ in model.named_children()]  # embedding, blocks, "
                    "head",
                    "local = pipe.local_model()  # this rank's stages",
                    "mine = [name for name, _ in local.named_children() if name in stack[1:-1]]",
                    "moe.memory.recompute_blocks(local, mine"
                    + ("" if blocks < 0 else f"[:{blocks}]")
                    + ")  # this rank's first blocks",
                ]
            lines.append("params = list(pipe.parameters())")
        lines.append(  # AdamW applied in `groups` groups (moe.memory), state offloaded or not
            f"opt = moe.memory.GroupedApply(params, groups={self.groups}, offload={self.offload!r})"
        )
        return "\n".join(lines)

    def m6_flags(self) -> str:
        """The M6 example's flags for this layout (torchrun with world = pp x dp x ep ranks),
        rendered from the typed values: every field the M6 run sets from them."""
        parallel, pipeline, settings = self.parallel, self.pipeline, self.moe_settings
        seqs = self.microbatches * self.micro_batch_seqs * self.dp * self.ep
        flags = [f"--dp {self.dp}", f"--ep {self.ep}", f"--data-parallel {parallel.data_parallel}"]
        flags += [f"--global-batch {seqs}", f"--micro-batch {self.micro_batch_seqs}"]
        if pipeline is not None:
            flags += [f"--pp {self.pp}", f"--schedule {pipeline.schedule}"]
            if pipeline.split != "children":
                flags.append(f"--split {pipeline.split}")
        flags.append(f"--alltoall {parallel.algorithm}")
        if parallel.overlap is not None:
            flags.append(f"--overlap {parallel.overlap}")
        if "capacity_factor" in settings:
            flags.append(f"--capacity-factor {settings['capacity_factor']:g}")
        if "fp8" in settings:
            fp8 = settings["fp8"]
            flags.append("--fp8 " + ("all" if fp8.dispatch and fp8.experts else
                                     "dispatch" if fp8.dispatch else "experts"))  # fmt: skip
        if settings.get("recompute"):
            flags.append("--moe-recompute")
        if self.recompute_blocks is not None:
            blocks = self.recompute_blocks
            flags.append("--checkpointing" + ("" if blocks < 0 else f" {blocks}"))
        if "spare_slots" in settings:
            flags.append(f"--spare-slots {settings['spare_slots']}")
        if self.offload:
            flags.append(f"--offload {self.offload}")
        if self.groups > 1:
            flags.append(f"--groups {self.groups}")
        return " ".join(flags)


def render(value) -> str:
    """Python source for `value`: a dataclass as its constructor with the fields that differ
    from their defaults (a PipelineConfig always names its schedule), else repr."""
    if not is_dataclass(value):
        return repr(value)
    args = []
    for f in fields(value):
        v = getattr(value, f.name)  # (a field without a default is always named)
        if v != f.default or (isinstance(value, PipelineConfig) and f.name == "schedule"):
            args.append(f"{f.name}={render(v)}")
    return f"{type(value).__name__}({', '.join(args)})"
