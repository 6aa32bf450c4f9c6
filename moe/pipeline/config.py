"""PipelineConfig: the typed settings of a pipelined run, checked when built (a bad value is a
ValueError naming the field) and agreed across ranks before any work (moe.pipeline.runner)."""

from dataclasses import dataclass, fields

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

# name (case-insensitive) -> PyTorch's schedule class; one stage per pp rank. The multi-stage
# schedules (Interleaved1F1B, ZBV, DualPipeV) need virtual stages: not supported yet.
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class PipelineConfig:
    """schedule: "GPipe" or "1F1B" (PyTorch's ScheduleGPipe / Schedule1F1B).
    microbatches: micro-batches per step; every stage's batch must split into equal ones.
    stages: the model's child names per stage, in order, each child once (None: an even split
    by child count, earlier stages taking the remainder).
    scale_grads: False (default): the loss function's micro-batch losses are summed, so it
    normalises them itself; True: PyTorch divides every gradient by `microbatches` after the
    step (loss_fn then returns a mean per micro-batch).
    sync_params: broadcast each stage's parameters and buffers from the stage's first rank
    (its dp x ep ranks only) before it is parallelized, so its ranks start from one model."""

    schedule: str = "1F1B"
    microbatches: int = 2
    stages: tuple[tuple[str, ...], ...] | None = None
    scale_grads: bool = False
    sync_params: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, str) or self.schedule.lower() not in SCHEDULES:
            names = ", ".join(cls.__name__.removeprefix("Schedule") for cls in SCHEDULES.values())
            raise ValueError(
                f"PipelineConfig.schedule must be one of {names}, got {self.schedule!r}"
            )
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"PipelineConfig.microbatches must be an int >= 1, got {m!r}")
        for name in ("scale_grads", "sync_params"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"PipelineConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.stages is not None:
            object.__setattr__(self, "stages", _stage_names(self.stages))

    @property
    def schedule_class(self) -> type:
        return SCHEDULES[self.schedule.lower()]

    @property
    def aux_scale(self) -> float:
        """Weight of one micro-batch's aux loss in the backward: 1/microbatches, so a step's aux
        loss is the mean over its micro-batches (1 when the schedule divides by them itself)."""
        return 1.0 if self.scale_grads else 1.0 / self.microbatches

    def check_stages(self, pp: int) -> None:
        """What depends on the number of stages: one stage list per pp rank; 1F1B needs at
        least as many micro-batches as stages (PyTorch's rule, checked here before any work)."""
        if self.stages is not None and len(self.stages) != pp:
            raise ValueError(f"PipelineConfig.stages has {len(self.stages)} stages, but pp={pp}")
        if self.schedule.lower() == "1f1b" and self.microbatches < pp:
            raise ValueError(
                f"PipelineConfig.microbatches={self.microbatches} is fewer than the {pp} stages: "
                "1F1B needs at least one micro-batch per stage"
            )

    def record(self) -> dict:
        """Every field as a JSON scalar (compared across ranks)."""
        out = {f"pipeline.{f.name}": getattr(self, f.name) for f in fields(self)}
        out["pipeline.schedule"] = self.schedule.lower()
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
