"""--layout auto: the M6 example asks moe.plan for the top layout of its config on the world it
was launched with, applies it to the flags it maps to (pp, dp, ep, --data-parallel, --schedule,
--micro-batch, --checkpointing, --offload, --groups, --alltoall) and says why.

The cluster is this machine's world as one node of `--cluster FILE` (a moe.plan cluster
profile, untrusted JSON read by Cluster.load) or of the H100 preset, with --device-memory-gb
as each device's memory when given. The search covers what the example runs: every pipeline
schedule, ddp / fsdp, micro-batches, whole-block recompute (--checkpointing) or none, offload
and groups; no overlap chunks, replicas or FP8 (flags of their own).
"""

from __future__ import annotations

from dataclasses import replace

import moe
from examples.m6.config import M6Config
from moe.memory import GroupedApply
from moe.pipeline import SCHEDULES
from moe.plan import Cluster, Layout, Prediction, SearchSpace, from_planner_model, preset, search

GiB = 2**30
# the flags --layout auto sets: given with it, each is refused by name
LAYOUT_FLAGS = ("--pp", "--dp", "--ep", "--schedule", "--micro-batch", "--data-parallel",
                "--alltoall", "--groups", "--offload", "--checkpointing", "--spare-slots")  # fmt: skip


def add_layout_args(g) -> None:
    g.add_argument(
        "--layout",
        choices=("auto",),
        help="auto: the layout moe.plan ranks first for this config on the launched world "
        "(sets " + ", ".join(LAYOUT_FLAGS[:-1]) + ")",
    )
    g.add_argument(
        "--cluster",
        help="with --layout auto: a moe.plan cluster profile (JSON) instead of the h100 preset",
    )


def given_flags(argv: list[str]) -> set[str]:
    """The --flags written on the command line (`--flag value` and `--flag=value`)."""
    return {w.split("=", 1)[0] for w in argv if w.startswith("--")}


def check_layout_args(args, argv: list[str]) -> None:
    """A ValueError naming a flag given with --layout auto, or --cluster without it."""
    if args.layout is None:
        if args.cluster is not None:
            raise ValueError("--cluster needs --layout auto")
        return
    clash = [f for f in LAYOUT_FLAGS if f in given_flags(argv)]
    if clash:
        raise ValueError(
            f"--layout auto sets the layout; drop {', '.join(clash)} (or drop --layout auto)"
        )
    if args.plan:
        raise ValueError("--layout auto trains; --plan prints the memory plan: choose one")


def cluster_for(args, world: int) -> Cluster:
    """One node of `world` devices: --cluster FILE's, or the h100 preset's."""
    if args.cluster is not None:
        base = Cluster.load(args.cluster)
        cluster = base.with_nodes(1, world)
    else:
        cluster = preset("h100", nodes=1, gpus_per_node=world)
    if args.device_memory_gb is not None:
        cluster = replace(cluster, device_memory_gib=args.device_memory_gb)
    return cluster


def ranked(cfg: M6Config, world: int, global_batch: int, cluster: Cluster) -> list[Prediction]:
    """The planner's fitting layouts the example runs, fastest first."""
    spec = from_planner_model(cfg, cfg.name)
    tokens = global_batch * cfg.seq_len
    space = SearchSpace(
        schedules=tuple(SCHEDULES),
        recompute=("none", "full"),
        overlap=(1,),
        replicas=(0,),
        capacity_factors=(cfg.capacity_factor,),  # the run's: its layout is the one predicted
    )
    try:  # the planner's ranking: fastest first
        return search(spec, cluster, tokens, cfg.seq_len, space=space, top=10**6).fits
    except ValueError as e:  # nothing fits or splits: the closest layout and what binds it
        raise ValueError(f"--layout auto: {e}") from None


def apply_layout(args, pred: Prediction) -> None:
    """Set the example's flags from the planner's layout's typed values (the search tries no
    overlap, FP8 or replicas: those flags stay as given)."""
    lay = pred.layout
    parallel, pipeline = lay.parallel, lay.pipeline
    args.pp, args.dp, args.ep = lay.pp, lay.dp, lay.ep
    args.data_parallel = parallel.data_parallel
    args.pp_schedule = None if pipeline is None else pipeline.schedule
    args.split = "children" if pipeline is None else pipeline.split
    args.micro_batch = lay.micro_batch_seqs
    blocks = lay.recompute_blocks  # None: none; -1: every block; N: each rank's first N
    args.checkpointing = {None: False, -1: True}.get(blocks, blocks)
    args.offload = lay.offload or "none"
    args.groups = lay.groups
    args.alltoall = parallel.algorithm


def choose(args, cfg: M6Config, world: int) -> str:
    """Apply the top layout to `args`; the lines saying why (printed by rank 0)."""
    cluster = cluster_for(args, world)
    preds = ranked(cfg, world, args.global_batch, cluster)
    best = preds[0]
    apply_layout(args, best)
    args.auto_layout = best.layout.short()
    where = f"{world} x {cluster.name} ({cluster.device_memory_gib:g} GiB)"
    lines = [
        f"layout auto on {where}: {best.layout.short()}",
        f"  predicted {best.step_time * 1e3:.3g} ms a step, "
        f"{best.peak_memory / GiB:.3g} GiB peak per device; flags: {best.layout.m6_flags()}",
    ]
    if len(preds) > 1:
        second = preds[1]
        lines.append(
            f"  runner-up: {second.layout.short()} ({second.step_time * 1e3:.3g} ms, "
            f"{second.peak_memory / GiB:.3g} GiB)"
        )
    return "\n".join(lines)


def layout_auto(args, cfg: M6Config, world: int, rank: int) -> None:
    """With --layout auto: choose and apply the layout, rank 0 says why (a ValueError names
    what is wrong, the same on every rank: the choice is a function of the arguments)."""
    if args.layout == "auto":
        why = choose(args, cfg, world)
        if rank == 0 and not args.quiet:
            print(why)


def run_layout(model, opt, args, cfg: M6Config, world: int) -> Layout:
    """The layout this run built, read from its objects (the planner's flags run to it): the
    mesh, the Pipeline's PipelineConfig and ParallelConfig (--pp) or the micro-batches
    taken (--pp 1), this rank's MoE layers' settings and dispatchers (a stage without one:
    the settings every MoE layer was built with), the optimizer and the blocks recomputed on
    this rank."""
    from examples.m6.pipe import PipelineRun
    from examples.m6.setup import parallel_config

    piped = isinstance(model, PipelineRun)
    layers = [layer for _, layer in moe.moe_layers(model.modules if piped else model)]
    if piped:
        pipe = model.pipe
        pp, dp, ep = pipe.mesh.mesh.shape
        parallel, config = pipe.parallel, pipe.config
        schedule, v, m, split = (
            config.schedule,
            config.stages_per_rank,
            config.microbatches,
            config.split,
        )
    else:
        dp, ep = layers[0].mesh.mesh.shape if layers[0].mesh is not None else (1, 1)
        pp, parallel, schedule, v, split = 1, parallel_config(args), "none", 1, "children"
        m = args.global_batch // world // (args.micro_batch or args.global_batch // world)
    options = layers[0].config if layers else moe.MoEConfig(
        d_model=cfg.d_model, d_ff=cfg.d_ff, num_experts=cfg.num_experts, top_k=cfg.top_k,
        **cfg.moe_options(),
    )  # fmt: skip
    dispatcher = layers[0].dispatcher if layers else None
    recompute = "moe" if options.recompute else "none"
    if args.checkpointing:
        recomputed = getattr(args, "recomputed", [])
        recompute = "full" if args.checkpointing is True else f"blocks:{len(recomputed)}"
    grouped, fp8 = isinstance(opt, GroupedApply), options.fp8
    return Layout(
        int(pp), int(dp), int(ep), parallel.data_parallel, schedule, v, m,
        args.global_batch // (dp * ep) // m, recompute=recompute,
        offload=opt.offload if grouped else None, groups=opt.num_groups if grouped else 1,
        capacity_factor=options.capacity_factor,
        exchange=getattr(dispatcher, "algorithm", parallel.algorithm),
        overlap=int(getattr(dispatcher, "degree", parallel.overlap or 1)),
        fp8_dispatch=bool(fp8 and fp8.dispatch), fp8_experts=bool(fp8 and fp8.experts),
        replicas=options.spare_slots, split=split,
    )  # fmt: skip
