"""PipelineConfig: the typed settings of a pipelined run, checked when built (a bad value is a
ValueError naming the field) and agreed across ranks before any work (moe.pipeline.runner)."""

import math
from dataclasses import dataclass, fields

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from moe.pipeline.split import SPLITS, stage_sizes

# PyTorch's schedules by name (the class name without "Schedule", case-insensitive) and how
# they place stages: "single" one stage per rank; "loop" stage s on pp rank s % pp;
# "v" two stages per rank, rank r holding stages r and 2 pp - 1 - r.
_CLASSES = {
    ScheduleGPipe: "single",
    Schedule1F1B: "single",
    ScheduleInterleaved1F1B: "loop",
    ScheduleInterleavedZeroBubble: "loop",
    ScheduleZBVZeroBubble: "v",
    ScheduleDualPipeV: "v",
}
SCHEDULES = {cls.__name__.removeprefix("Schedule"): cls for cls in _CLASSES}
# the schedules that split the backward into input and weight gradients (zero bubble)
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MIN_STEP_TIMEOUT = 1.0  # seconds: PipelineConfig.step_timeout's lower bound
_BY_KEY = {name.lower(): name for name in SCHEDULES}


def schedule_style(schedule: str) -> str:
    """How the schedule places stages on ranks: "single", "loop" or "v" (case-insensitive)."""
    if not isinstance(schedule, str) or schedule.lower() not in _BY_KEY:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    return _CLASSES[SCHEDULES[_BY_KEY[schedule.lower()]]]


@dataclass(frozen=True)
class PipelineConfig:
    """schedule: one of SCHEDULES (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble,
    ZBVZeroBubble, DualPipeV: PyTorch's Schedule<name>), case-insensitive.
    microbatches: micro-batches per step; every stage's batch must split into equal ones.
    stages_per_rank: virtual stages per pp rank (1 for GPipe / 1F1B, 2 for the V schedules,
    any for the interleaved ones); the model is split into pp * stages_per_rank stages.
    stages: the model's child names per stage, in order, each child once (None: an even split
    by child count, earlier stages taking the remainder).
    scale_grads: False (default): the loss function's micro-batch losses are summed, so it
    normalises them itself; True: PyTorch divides every gradient by `microbatches` after the
    step (loss_fn then returns a mean per micro-batch).
    sync_params: broadcast each stage's parameters and buffers from the stage's first rank
    (its dp x ep ranks only) before it is parallelized, so its ranks start from one model.
    split: how stages=None splits the model: "children" (even child counts) or "params"
    (contiguous stages minimising the largest stage's parameter count; embedding first).
    step_timeout: seconds (>= MIN_STEP_TIMEOUT, 1) any rank waits for another inside a step (to
    enter it, each transfer and collective) before the step fails with PipelineStepError on
    every rank (moe.pipeline.faults); None: the default process group's timeout."""

    schedule: str = "1F1B"
    microbatches: int = 2
    stages_per_rank: int = 1
    stages: tuple[tuple[str, ...], ...] | None = None
    scale_grads: bool = False
    sync_params: bool = True
    split: str = "children"
    step_timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, str) or self.schedule.lower() not in _BY_KEY:
            raise ValueError(
                f"PipelineConfig.schedule must be one of {', '.join(SCHEDULES)}, "
                f"got {self.schedule!r}"
            )
        object.__setattr__(self, "schedule", _BY_KEY[self.schedule.lower()])
        for name in ("microbatches", "stages_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PipelineConfig.{name} must be an int >= 1, got {v!r}")
        style, v = self.style, self.stages_per_rank
        if (style == "single" and v != 1) or (style == "v" and v != 2):
            raise ValueError(
                f"PipelineConfig.stages_per_rank={v}: {self.schedule} runs "
                f"{'one stage' if style == 'single' else 'two stages'} per rank"
            )
        for name in ("scale_grads", "sync_params"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"PipelineConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.stages is not None:
            object.__setattr__(self, "stages", _stage_names(self.stages))
        if self.split not in SPLITS:
            raise ValueError(f"PipelineConfig.split must be one of {SPLITS}, got {self.split!r}")
        t = self.step_timeout
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
                raise ValueError(f"PipelineConfig.step_timeout must be seconds > 0, got {t!r}")
            if t < MIN_STEP_TIMEOUT:
                raise ValueError(
                    f"PipelineConfig.step_timeout must be at least {MIN_STEP_TIMEOUT:g} s, got "
                    f"{t!r}: a shorter wait fails steps that are merely slow (and the ranks "
                    "read each other's failures about once a second)"
                )
            object.__setattr__(self, "step_timeout", float(t))

    @property
    def schedule_class(self) -> type:
        return SCHEDULES[self.schedule]

    @property
    def style(self) -> str:
        """How the schedule places stages on ranks: "single", "loop" or "v"."""
        return schedule_style(self.schedule)

    def stage_ranks(self, pp: int) -> list[int]:
        """The pp rank of each of the pp * stages_per_rank stages."""
        n = pp * self.stages_per_rank
        if self.style == "v":
            return [s if s < pp else n - 1 - s for s in range(n)]
        return [s % pp for s in range(n)]

    @property
    def aux_scale(self) -> float:
        """Weight of one micro-batch's aux loss in the backward: 1/microbatches, so a step's aux
        loss is the mean over its micro-batches (1 when the schedule divides by them itself)."""
        return 1.0 if self.scale_grads else 1.0 / self.microbatches

    def check_stages(self, pp: int) -> None:
        """What depends on the number of ranks per pipeline (PyTorch's rules, checked here
        before any work): pp * stages_per_rank stage lists; 1F1B at least pp micro-batches,
        DualPipeV at least 2 pp; the interleaved ones a multiple of the rounds."""
        n, m = pp * self.stages_per_rank, self.microbatches
        if self.stages is not None and len(self.stages) != n:
            raise ValueError(
                f"PipelineConfig.stages has {len(self.stages)} stages, but pp={pp} x "
                f"stages_per_rank={self.stages_per_rank} = {n}"
            )
        least = {"1F1B": pp, "DualPipeV": n}.get(self.schedule, 1)
        if m < least:
            raise ValueError(
                f"PipelineConfig.microbatches={m}: {self.schedule} needs at least {least} "
                f"micro-batches at pp={pp}"
            )
        rounds = max(1, m // pp)
        if self.style == "loop" and m % rounds:
            raise ValueError(
                f"PipelineConfig.microbatches={m}: {self.schedule} needs a multiple of its "
                f"{rounds} rounds (microbatches // pp)"
            )

    def check_data_parallel(self, data_parallel: str) -> None:
        """PyTorch 2.13 drops the last stage's weight gradients when a split-backward schedule
        meets nested fully_shard units (a plain nn.Linear stage too; replicate is fine), and
        an MoE stage always nests (its experts are their own unit): refused before any work."""
        if self.schedule in SPLIT_BACKWARD and data_parallel == "fsdp":
            raise ValueError(
                f"schedule={self.schedule} with data_parallel='fsdp': PyTorch's split backward "
                "loses the last stage's weight gradients under nested fully_shard units; use "
                "data_parallel='ddp' or a schedule without zero bubble"
            )

    def check(self, pp: int, data_parallel: str, children: list[int]) -> None:
        """Everything the pipeline refuses before any work, given pp ranks per pipeline,
        parallelize's data_parallel and the stack's children (their parameter counts): the
        stage and micro-batch rules, split-backward with fsdp, and the split itself (one
        child per stage at least). moe.plan asks this of every layout it returns."""
        self.check_stages(pp)
        self.check_data_parallel(data_parallel)
        if self.stages is None:
            stage_sizes(children, pp * self.stages_per_rank, self.split)

    def record(self) -> dict:
        """Every field as a JSON scalar (compared across ranks)."""
        out = {f"pipeline.{f.name}": getattr(self, f.name) for f in fields(self)}
        stages = self.stages
        out["pipeline.stages"] = None if stages is None else "|".join(",".join(s) for s in stages)
        return out


def _stage_names(stages) -> tuple[tuple[str, ...], ...]:
    if isinstance(stages, str) or not isinstance(stages, (list, tuple)) or not stages:
        raise ValueError(f"PipelineConfig.stages must be a list of lists of names, got {stages!r}")
    out = []
    for i, stage in enumerate(stages):
        if isinstance(stage, str) or not isinstance(stage, (list, tuple)) or not stage:
            raise ValueError(
                f"PipelineConfig.stages[{i}] must be a non-empty list of names, got {stage!r}"
            )
        if not all(isinstance(n, str) for n in stage):
            raise ValueError(f"PipelineConfig.stages[{i}] must hold module names, got {stage!r}")
        out.append(tuple(stage))
    return tuple(out)
