"""The M6 example's command line: arguments, the named config with its overrides, and every
check that can fail before any work starts (a bad argument is one `error: ...` line, exit 2)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

import moe
from examples.device import add_device_args, threads_problem
from examples.m6.auto_layout import add_layout_args
from examples.m6.config import DEFAULT_GLOBAL_BATCH, TRAIN_DEFAULTS, M6Config, get_config
from examples.m6.pipe_args import check_pipeline
from examples.m6.plan import check_layout
from moe.pipeline import SCHEDULES
from moe.pipeline.split import SPLITS

DESCRIPTION = """Train the M6-style multimodal MoE model: one command from a laptop CPU to DP x EP.

    python examples/m6/train.py                          # tiny config, digits, CPU, about a minute
    python examples/m6/train.py --resume --steps 800     # continue from the newest checkpoint step
    python examples/m6/train.py --dense                  # dense baseline at equal active FLOPs
    python examples/m6/train.py --config m6-tiny-gpu     # the same task sized for one GPU
    torchrun --nproc-per-node 4 examples/m6/train.py --dp 2 --ep 2
    torchrun --nproc-per-node 4 examples/m6/train.py --pp 2 --ep 2   # 2 pipeline stages
    torchrun --nproc-per-node 4 examples/m6/train.py --layout auto   # moe.plan's top layout
    python examples/m6/train.py --config m6-1t --plan --world-size 480 --device-memory-gb 32

SIGTERM or SIGINT (Ctrl-C) finishes the current step (under torchrun: the steps up to the
next --log-every read), saves a checkpoint and exits with status 130 (SIGINT) or 143
(SIGTERM); --resume continues from it. A second signal exits at once without saving.
"""


class UsageError(ValueError):
    """A bad command line, reported before any work starts."""


class RunError(RuntimeError):
    """The run could not go on (e.g. a checkpoint could not be saved: the disk is full); one
    `error: ...` line, exit status 1, the previous checkpoint intact."""


@contextmanager
def usage_errors():
    """Config and layout validation errors are the user's: report them as UsageError."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from e


def _capacity(text: str) -> float | None:
    return None if text.lower() in ("none", "dropless") else float(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--config",
        default="m6-tiny",
        help="m6-tiny, m6-tiny-gpu (one GPU), m6-base, m6-10b, m6-100b, m6-1t",
    )
    g.add_argument("--router", help="topk, prototype (M6-T), switch, gshard, noisy_topk")
    g.add_argument("--experts", type=int, help="experts per MoE layer (0: dense)")
    g.add_argument("--top-k", type=int, help="experts per token (prototypes for 'prototype')")
    g.add_argument("--moe-every", type=int, help="MoE FFN in every n-th block")
    g.add_argument(
        "--capacity-factor",
        type=_capacity,
        default=argparse.SUPPRESS,
        help="float or 'none' (dropless)",
    )
    g.add_argument("--dense", action="store_true", help="dense baseline at equal active FLOPs")
    g.add_argument(
        "--fp8",
        help="FP8 in every MoE layer: dispatch (tokens sent as e4m3 + 1x128 scales), experts "
        "(every expert GEMM in e4m3, rowwise), all (both), off (default); masters stay as they are. "
        "It pays where the expert GEMMs are large (wide d_ff, many rows per expert: Mixtral-class "
        "shapes on Hopper) and costs at tiny widths like m6-tiny's, where the quantization passes "
        "outweigh the GEMMs; python -m moe.plan --fp8 predicts which and says why (docs/fp8.md)",
    )
    g = p.add_argument_group("data and training")
    g.add_argument("--data", help="folder with captions.jsonl (default: scikit-learn digits)")
    g.add_argument(
        "--steps", type=int, default=500, help="training steps in all (the schedule's length)"
    )
    g.add_argument(
        "--global-batch",
        type=int,
        help=f"examples per step, all ranks (default {DEFAULT_GLOBAL_BATCH}; "
        f"{TRAIN_DEFAULTS['m6-tiny-gpu']['global_batch']} for m6-tiny-gpu)",
    )
    g.add_argument("--micro-batch", type=int, help="examples per forward per rank (default: all)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument(
        "--warmup", type=int, default=30, help="linear warm-up steps, then cosine decay to 10%%"
    )
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights, data order and split")
    add_device_args(g)  # --device, --precision, --threads
    _output_args(p)
    _parallel_args(p)
    g = p.add_argument_group("memory plan (meta device, no allocation)")
    g.add_argument("--plan", action="store_true", help="print parameter counts and the memory plan")
    g.add_argument("--world-size", type=int, help="devices of the planned cluster")
    g.add_argument(
        "--device-memory-gb", type=float, help="per device, in GiB (a '32 GB' V100 has 32 GiB)"
    )
    g.add_argument(
        "--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="planned parameter dtype"
    )
    g.add_argument(
        "--micro-batch-tokens", type=int, help="planned tokens per device per micro-batch"
    )
    return p.parse_args(argv)


def _output_args(p: argparse.ArgumentParser) -> None:
    """The flags of the run directory, checkpoints, evaluation and logging."""
    g = p.add_argument_group("outputs")
    g.add_argument("--run-dir", help="default runs/<config>")
    g.add_argument("--resume", action="store_true", help="continue from <run-dir>/checkpoint")
    g.add_argument(
        "--restart-schedule",
        action="store_true",
        help="with --resume: start a new warm-up + cosine at the resume step over the steps "
        "left (default: continue the checkpoint's learning-rate schedule)",
    )
    g.add_argument("--save-every", type=int, default=0, help="also checkpoint every n steps")
    g.add_argument(
        "--stop-after", type=int, help="stop (and checkpoint) after this step, as if preempted"
    )
    g.add_argument(
        "--max-seconds",
        type=float,
        help="end training at the first step past this many seconds, then evaluate as usual "
        "(a fixed-time benchmark; the learning-rate schedule still follows --steps)",
    )
    g.add_argument(
        "--count-syncs",
        action="store_true",
        help="count the host syncs of the training steps (CUDA: torch.cuda.set_sync_debug_mode)",
    )
    g.add_argument("--eval-every", type=int, help="held-out loss every n steps (default steps/10)")
    g.add_argument("--eval-batch", type=int, default=256, help="examples per held-out forward")
    g.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="read the metrics back every n steps: the only host sync of training",
    )
    g.add_argument("--no-plots", action="store_true", help="write no PNGs at the end")
    g.add_argument("--quiet", action="store_true", help="no progress bar or summary")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    """The flags of expert x data parallelism and of the memory features."""
    g = p.add_argument_group("parallelism (under torchrun)")
    g.add_argument("--dp", type=int, help="data-parallel size (default world / ep)")
    g.add_argument("--ep", type=int, help="expert-parallel size (default 1)")
    g.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages over the ranks (world = pp x dp x ep; default 1: none); "
        "--micro-batch is then examples per pipeline micro-batch (default: 2 pp of them)",
    )
    g.add_argument(
        "--schedule",
        dest="pp_schedule",  # args.schedule is the learning-rate schedule (schedule.py)
        help="with --pp: PyTorch's pipeline schedule, one of "
        + ", ".join(SCHEDULES)
        + " (default 1F1B; the interleaved and V ones run 2 stages per rank)",
    )
    g.add_argument(
        "--alltoall",
        choices=("auto", "flat", "hierarchical"),
        default="auto",
        help="auto: hierarchical when the ranks span more than one node",
    )
    g.add_argument(
        "--data-parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="ddp: dense weights replicated; fsdp: sharded over all ranks (FSDP2)",
    )
    g.add_argument(
        "--timeout", type=float, default=300.0, help="collective timeout in seconds (dead ranks)"
    )
    g.add_argument(
        "--groups", type=int, default=1, help="optimizer apply groups (Whale num_apply_group)"
    )
    g.add_argument(
        "--offload",
        choices=("none", "optimizer", "all"),
        default="none",
        help="optimizer state (optimizer), also the fp32 masters (all) in host memory "
        "(moe.memory.GroupedApply; any layout)",
    )
    g.add_argument(
        "--checkpointing",
        type=int,
        nargs="?",
        const=True,
        default=False,
        metavar="N",
        help="recompute blocks in backward: every block, or each rank's first N",
    )
    g.add_argument(
        "--moe-recompute",
        action="store_true",
        help="recompute only the MoE layers in backward (MoEConfig.recompute)",
    )
    g.add_argument(
        "--overlap", type=int, help="overlapped expert exchange of this degree (ParallelConfig)"
    )
    g.add_argument(
        "--split",
        choices=SPLITS,
        default="children",
        help="with --pp: stages by even child counts or by parameters (PipelineConfig.split)",
    )
    add_layout_args(g)
    g.add_argument(
        "--rebalance-every",
        type=int,
        default=0,
        help="re-place experts on EP ranks by their load every n steps (0: never)",
    )
    g.add_argument(
        "--spare-slots",
        type=int,
        default=0,
        help="expert slots per MoE layer for copies of hot experts, placed by "
        "--rebalance-every (a multiple of --ep; 0: none)",
    )


def resolve_config(args) -> M6Config:
    """The named config with the command line's overrides; fills in the config's training
    defaults (e.g. its global batch) where the command line gave none."""
    cfg = get_config(args.config)
    defaults = {"global_batch": DEFAULT_GLOBAL_BATCH, **TRAIN_DEFAULTS.get(cfg.name, {})}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    changes = {
        field: getattr(args, arg)
        for field, arg in (
            ("router", "router"),
            ("num_experts", "experts"),
            ("top_k", "top_k"),
            ("moe_every", "moe_every"),
        )
        if getattr(args, arg) is not None
    }
    if hasattr(args, "capacity_factor"):
        changes["capacity_factor"] = args.capacity_factor
    if getattr(args, "spare_slots", 0):
        changes["spare_slots"] = args.spare_slots
    if getattr(args, "fp8", None) is not None:
        changes["fp8"] = args.fp8
    if getattr(args, "moe_recompute", False):
        changes["moe_recompute"] = True
    cfg = cfg.replace(**changes) if changes else cfg
    return cfg.equal_flops_dense() if args.dense else cfg


# Integer flags and their least value (None: not given, the default applies).
POSITIVE_INTS = (
    ("dp", 1),
    ("ep", 1),
    ("groups", 1),
    ("eval_batch", 1),
    ("eval_every", 1),
    ("log_every", 1),
    ("save_every", 0),
    ("micro_batch", 1),
    ("pp", 1),
    ("overlap", 1),
)


def check_args(args, cfg: M6Config, world: int) -> None:
    """Every error we can find before building anything."""
    for name, low in POSITIVE_INTS:
        value = getattr(args, name)
        if value is not None and value < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    ep, pp = args.ep or 1, args.pp
    dp = args.dp or max(world // (pp * ep), 1)
    if world == 1 and pp * dp * ep > 1:
        flags = f"--pp {pp} --dp {dp} --ep {ep}" if pp > 1 else f"--dp {dp} --ep {ep}"
        raise UsageError(
            f"{flags} needs {pp * dp * ep} processes: launch with "
            f"torchrun --nproc-per-node {pp * dp * ep} examples/m6/train.py ..."
        )
    with usage_errors():
        check_pipeline(args, cfg, world)
        if world > 1 and pp == 1:
            check_layout(cfg, world, dp, ep)
    if args.ep and args.ep > 1 and not cfg.is_moe:
        raise UsageError(f"--ep {args.ep} needs an MoE model; {cfg.name} is dense")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if threads_problem(args.threads):
        raise UsageError(threads_problem(args.threads))
    if args.rebalance_every < 0:
        raise UsageError(f"--rebalance-every must be >= 0, got {args.rebalance_every}")
    if args.spare_slots < 0 or args.spare_slots % ep:
        raise UsageError(
            f"--spare-slots must be a non-negative multiple of --ep {ep}, got {args.spare_slots}"
        )
    check_spare_slots(args.spare_slots, cfg, ep)
    if cfg.fp8 != "off" and not cfg.is_moe:
        raise UsageError(f"--fp8 {cfg.fp8} needs an MoE model; {cfg.name} is dense")
    if args.spare_slots and not cfg.is_moe:
        raise UsageError(
            f"--spare-slots {args.spare_slots} needs an MoE model; {cfg.name} is dense"
        )
    if args.stop_after is not None and not 0 < args.stop_after < args.steps:
        raise UsageError(
            f"--stop-after must be in (0, --steps={args.steps}), got {args.stop_after}"
        )
    if args.global_batch < 1 or args.global_batch % world and pp == 1:
        raise UsageError(
            f"--global-batch {args.global_batch} must be a positive multiple of the {world} ranks"
        )
    per_rank = args.global_batch // world
    micro = args.micro_batch or per_rank
    if pp == 1 and (micro < 1 or per_rank % micro):
        raise UsageError(f"--micro-batch {micro} must divide the per-rank batch {per_rank}")
    if args.max_seconds is not None and not (
        math.isfinite(args.max_seconds) and args.max_seconds > 0
    ):
        raise UsageError(f"--max-seconds must be a finite number > 0, got {args.max_seconds}")
    if args.max_seconds is not None and world > 1:  # each rank's clock would stop it elsewhere
        raise UsageError(
            "--max-seconds is for one process (the ranks would stop at different steps)"
        )
    for name in ("lr", "weight_decay", "clip", "timeout"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (name in ("lr", "timeout") and value == 0):
            bound = "> 0" if name in ("lr", "timeout") else ">= 0"
            raise UsageError(
                f"--{name.replace('_', '-')} must be a finite number {bound}, got {value}"
            )
    if not isinstance(args.checkpointing, bool) and args.checkpointing < 1:
        raise UsageError(f"--checkpointing N must be >= 1, got {args.checkpointing}")
    if args.split != "children" and pp == 1:
        raise UsageError(f"--split {args.split} needs --pp > 1 (pipeline stages)")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.data and not (Path(args.data) / "captions.jsonl").is_file():
        raise UsageError(f"--data {args.data}: no captions.jsonl there")
    if cfg.is_moe:  # the MoE options (router, capacity factor, ...) as MoELayer will see them
        with usage_errors():
            moe.MoEConfig(
                d_model=cfg.d_model,
                d_ff=cfg.d_ff,
                num_experts=cfg.num_experts,
                top_k=cfg.top_k,
                **cfg.moe_options(),
            )
    if args.restart_schedule and not args.resume:
        raise UsageError("--restart-schedule needs --resume (a fresh run starts its schedule)")
    if args.resume:
        from examples.m6.ckpt_io import complete_steps

        if not complete_steps(run_dir(args, cfg) / "checkpoint"):
            raise UsageError(f"--resume: no checkpoint in {run_dir(args, cfg) / 'checkpoint'}")
    probe_run_dir(run_dir(args, cfg))


def check_spare_slots(spare: int, cfg: M6Config, ep: int) -> None:
    """Copies of an expert live on different EP ranks: at most E x (ep - 1) spare slots (one
    copy of each expert in one process), checked before any tensor is allocated."""
    most = cfg.num_experts * (ep - 1) if ep > 1 else cfg.num_experts
    if cfg.is_moe and spare > most:
        rule = f"{cfg.num_experts} experts x (--ep {ep} - 1)" if ep > 1 else "one copy each"
        raise UsageError(
            f"--spare-slots {spare}: at most {most} for {cfg.num_experts} experts "
            f"on --ep {ep} ({rule}: no two copies of an expert on one rank)"
        )


def probe_run_dir(path: Path) -> None:
    """Create the run directory and write a file there now, not after hours of training."""
    probe = path / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
    except OSError as e:
        raise UsageError(f"--run-dir {path} is not writable: {e}") from None
    finally:  # a full disk creates the file, then fails the write: never leave it
        with contextlib.suppress(OSError):
            probe.unlink()


def run_dir(args, cfg: M6Config) -> Path:
    return Path(args.run_dir or Path("runs") / cfg.name)
