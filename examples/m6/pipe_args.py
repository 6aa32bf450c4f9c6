"""The checks of --pp and --schedule (cli.check_args calls them before any work): the
layout pp x dp x ep = world, the schedule and its micro-batch rules (moe.pipeline's own
PipelineConfig checks), and the features --pp does not run yet, each refused by name."""

from __future__ import annotations

from examples.m6.config import M6Config
from moe.pipeline import SCHEDULES

# flags --pp refuses for now: (attribute, flag, what is not there yet under --pp)
NOT_YET = (
    ("spare_slots", "--spare-slots", "expert replicas per stage"),
    ("dense", "--dense", "the dense baseline on stages"),
)


def data_ranks(args, world: int) -> int:
    """The ranks a global batch is split over: dp x ep pipelines (world / pp)."""
    return max(world // args.pp, 1)


def check_pipeline(args, cfg: M6Config, world: int) -> None:
    """A ValueError naming the flag for a bad --pp / --schedule setting (cli wraps it)."""
    from examples.m6.pipe import default_micro_batch, pipeline_config

    pp, ep = args.pp, args.ep or 1
    if pp == 1:
        if args.pp_schedule is not None:
            raise ValueError(f"--schedule {args.pp_schedule} needs --pp > 1 (pipeline stages)")
        return
    for attr, flag, what in NOT_YET:
        if getattr(args, attr):
            raise ValueError(f"--pp {pp} with {flag}: {what} not supported yet")
    dp = args.dp or max(world // (pp * ep), 1)
    if world > 1 and pp * dp * ep != world:
        raise ValueError(
            f"--pp {pp} x --dp {dp} x --ep {ep} = {pp * dp * ep} is not the world size {world}"
        )
    if ep > 1 and cfg.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={cfg.num_experts} of {cfg.name}")
    width = dp * ep
    if args.global_batch < 1 or args.global_batch % width:
        raise ValueError(
            f"--global-batch {args.global_batch} must be a positive multiple of the {width} "
            f"pipelines (dp {dp} x ep {ep})"
        )
    per_pipeline = args.global_batch // width
    micro = args.micro_batch or default_micro_batch(pp, per_pipeline)
    if per_pipeline % micro:
        raise ValueError(
            f"--micro-batch {micro} must divide the per-pipeline batch {per_pipeline} "
            f"(--global-batch {args.global_batch} / {width} pipelines)"
        )
    name = args.pp_schedule
    if name is not None and name.lower() not in {s.lower() for s in SCHEDULES}:
        raise ValueError(f"--schedule {name} is not one of {', '.join(SCHEDULES)}")
    config = pipeline_config(args, per_pipeline)
    try:
        config.check_stages(pp)
        config.check_data_parallel(args.data_parallel)
    except ValueError as e:
        raise ValueError(
            f"--pp {pp} --schedule {config.schedule} --micro-batch {micro} "
            f"({per_pipeline // micro} micro-batches): {e}"
        ) from None
    stages, children = pp * config.stages_per_rank, cfg.n_layers + 2
    if stages > children:
        raise ValueError(
            f"--pp {pp} --schedule {config.schedule}: {stages} stages, but {cfg.name} has "
            f"{children} pieces to split (embedding, {cfg.n_layers} blocks, head)"
        )
