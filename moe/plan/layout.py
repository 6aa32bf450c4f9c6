"""Layout: one point of the planner's search (how a run is parallelized and what it trades
memory for), and the code that applies it (parallelize / Pipeline keywords, M6 flags)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                  "DualPipeV")  # fmt: skip
RECOMPUTE = ("none", "moe", "full")  # or "blocks:N": the N first blocks of each rank recomputed
OFFLOAD = (None, "optimizer", "all")


@dataclass(frozen=True)
class Layout:
    """pp x dp x ep devices; `schedule` and `stages_per_rank` when pp > 1 ("none" / 1 at
    pp = 1); `microbatches` of `micro_batch_seqs` sequences per pipeline and step (at pp = 1:
    gradient accumulation); the rest as moe.parallel / moe.memory / MoEConfig name them."""

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

    def record(self) -> dict:
        return asdict(self)

    def code(self) -> str:
        """The calls that apply this layout with moe (mesh, parallelize or Pipeline, MoEConfig
        fields), as a user pastes them into a torchrun script."""
        moe_cfg = []
        if self.capacity_factor:
            moe_cfg.append(f"capacity_factor={self.capacity_factor:g}")
        if self.recompute == "moe":
            moe_cfg.append("recompute=True")
        if self.fp8_dispatch or self.fp8_experts:
            moe_cfg.append(
                f"fp8=FP8Config(dispatch={self.fp8_dispatch}, experts={self.fp8_experts})"
            )
        if self.replicas:
            moe_cfg.append(f"spare_slots={self.replicas}")
        parallel = (
            f'ParallelConfig("{self.data_parallel}", "{self.exchange}"'
            + (f", overlap={self.overlap}" if self.overlap > 1 else "")
            + ")"
        )
        lines = ["import moe.memory, moe.parallel" + (", moe.pipeline" if self.pp > 1 else "")]
        lines.append("from moe.parallel import ParallelConfig")
        if self.fp8_dispatch or self.fp8_experts:
            lines.append("from moe.fp8 import FP8Config")
        if self.recompute.startswith("blocks:"):
            lines.append("from moe.memory.recompute import find_repeated_blocks")
        lines.append(f"# MoELayer / MoEConfig: {', '.join(moe_cfg) or 'defaults'}")
        if self.recompute == "full":
            lines.append("moe.memory.recompute_blocks(model)  # every block recomputed")
        elif self.recompute.startswith("blocks:"):
            n = self.recompute.split(":")[1]
            lines.append(
                f"moe.memory.recompute_blocks(model, find_repeated_blocks(model)"
                f"[:{n}])  # moe.memory.recompute; per stage: its first {n} blocks"
            )
        if self.pp == 1:
            lines += [
                f"mesh = moe.parallel.init_mesh(dp={self.dp}, ep={self.ep})",
                f"moe.parallel.parallelize(model, mesh, config={parallel})",
                f"# {self.microbatches} micro-batches of {self.micro_batch_seqs} sequences a step",
            ]
        else:
            lines += [
                f"mesh = moe.pipeline.init_pipeline_mesh(pp={self.pp}, dp={self.dp}, ep={self.ep})",
                f'config = moe.pipeline.PipelineConfig("{self.schedule}", '
                f"microbatches={self.microbatches}, stages_per_rank={self.stages_per_rank})",
                f"pipe = moe.pipeline.Pipeline(model, mesh, config, loss_fn, parallel={parallel})",
            ]
        lines.append(  # AdamW applied in `groups` groups (moe.memory), state offloaded or not
            f"opt = moe.memory.GroupedApply(params, groups={self.groups}, offload={self.offload!r})"
        )
        return "\n".join(lines)

    def m6_flags(self) -> str:
        """The M6 example's flags for this layout (torchrun with world = pp x dp x ep ranks)."""
        flags = [f"--dp {self.dp}", f"--ep {self.ep}", f"--data-parallel {self.data_parallel}"]
        if self.pp > 1:
            flags += [f"--pp {self.pp}", f"--schedule {self.schedule}"]
        if self.ep > 1:
            flags.append(f"--alltoall {self.exchange}")
        if self.offload:
            flags.append(f"--offload {self.offload}")
        if self.groups > 1:
            flags.append(f"--groups {self.groups}")
        if self.recompute == "full" or self.recompute.startswith("blocks:"):
            flags.append("--checkpointing")  # every block (the M6 flag is all or none)
        if self.replicas:
            flags.append(f"--spare-slots {self.replicas}")
        return " ".join(flags)
