"""Train the M6-style multimodal MoE model (the loop; arguments in cli.py, checkpoint steps
in ckpt_io.py, metrics in metrics.py). `python examples/m6/train.py --help` for usage.

Loss convention (what makes 1 rank and N ranks agree): every rank takes a contiguous
1/world shard of the same global batch; its loss is its summed token cross-entropy times
world / (target tokens in the global batch), plus each micro-batch's aux loss / micro-batches.
Gradients averaged over ranks are then exactly the gradients of the global-batch mean.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples.m6` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import moe  # noqa: E402
from examples.device import autocast, resolve_device, set_threads  # noqa: E402
from examples.m6 import data as m6data  # noqa: E402
from examples.m6 import schedule as lr_schedule  # noqa: E402
from examples.m6.auto_layout import check_layout_args, layout_auto, run_layout  # noqa: E402
from examples.m6.ckpt_io import rank0_then_all, resume, save_step, start_fresh  # noqa: E402
from examples.m6.cli import (  # noqa: E402
    RunError,
    UsageError,
    check_args,
    parse_args,
    resolve_config,
    run_dir,
    usage_errors,
)
from examples.m6.config import M6Config  # noqa: E402
from examples.m6.evaluate import evaluate  # noqa: E402
from examples.m6.metrics import MetricsLog, Progress, StepMetrics, new_history  # noqa: E402
from examples.m6.model import count_params  # noqa: E402
from examples.m6.pipe import PipelineRun, for_eval, pipeline_description  # noqa: E402
from examples.m6.plan import default_ep, plan_report  # noqa: E402
from examples.m6.report import final_evaluation, make_plots, print_summary  # noqa: E402
from examples.m6.run_folder import RunLock  # noqa: E402
from examples.m6.runtime import Runtime  # noqa: E402
from examples.m6.setup import (  # noqa: E402
    clip_gradients,
    init_distributed,
    make_optimizer,
    setup_parallel,
    topology,
)
from examples.m6.signals import Interrupted, StopOnSignal  # noqa: E402
from examples.m6.syncs import SyncCounter  # noqa: E402
from examples.m6.trace_io import open_trace  # noqa: E402
from examples.settings import settings_line  # noqa: E402

__all__ = ["Interrupted", "RunError", "UsageError", "main", "run"]


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10%: a pure function of the step (resumable).
    The run's schedule (examples/m6/schedule.py: a resumed run keeps its checkpoint's)."""
    schedule = getattr(args, "schedule", None) or lr_schedule.from_args(args)
    return schedule.lr_at(step)


def train_step(model, opt, data, enc, step: int, args, rt: Runtime) -> torch.Tensor:
    """One optimizer step over this rank's shard of the global batch. Returns this rank's
    metric row on the device (StepMetrics.row); nothing is read back to the host."""
    world = rt.world
    global_idx = m6data.global_batch_indices(step, len(enc), args.global_batch, args.seed)
    if isinstance(model, PipelineRun):  # --pp: the same math through the pipeline's stages
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        opt.zero_grad(set_to_none=True)
        row = model.step(data, enc, global_idx, rt)
        model.clip(args.clip)
        opt.step()
        model.sync_tied()
        return row
    global_targets = (enc.labels_NL[global_idx] != m6data.IGNORE).sum()  # host tensor, no read
    scale = world / global_targets.double()
    local_idx = m6data.shard(global_idx, rt.rank, world)
    micro = local_idx.split(args.micro_batch or local_idx.shape[0])
    for group in opt.param_groups:
        group["lr"] = lr_at(step, args)
    opt.zero_grad(set_to_none=True)
    metrics = StepMetrics(moe.moe_layers(model), rt.device)
    for idx in micro:
        b = m6data.make_batch(data, enc, idx).to(rt.device)
        with rt.autocast:
            logits_BLV = model(b.images_BCHW, b.text_BL, b.prompt_len_B, b.has_image_B)
        ce = F.cross_entropy(
            logits_BLV.float().flatten(0, 1),
            b.labels_BL.flatten(),
            ignore_index=m6data.IGNORE,
            reduction="sum",
        )
        aux = moe.aux_loss(model).to(ce.device, non_blocking=True)  # dense: a CPU zero
        (ce * scale + aux / len(micro)).backward()
        metrics.add(ce, aux, len(micro))
    if args.spare_slots:  # copies of one expert: their gradients summed before clip and step
        moe.parallel.sum_replica_grads(model)
    clip_gradients(model, opt, args, rt.mesh)
    opt.step()
    moe.update_router_biases(model)
    return metrics.row(global_targets)


def run_settings(args, cfg: M6Config, world: int, device) -> str:
    """The settings that change the math of this run, in one line (examples/settings.py)."""
    fp8 = cfg.moe_options().get("fp8") if cfg.is_moe else None
    ep = args.ep or 1
    pp = getattr(args, "pp", 1)
    extra = []
    if cfg.is_moe:
        cf = cfg.capacity_factor
        extra.append(f"{cfg.num_experts} experts top-{cfg.top_k} {cfg.router}, capacity "
                     + ("dropless" if cf is None else f"factor {cf:g}"))  # fmt: skip
    else:
        extra.append("dense FFNs")
    if args.checkpointing:
        extra.append("activation checkpointing")
    if pp > 1:
        extra.append(pipeline_description(args, world))
    return settings_line(
        precision=args.precision, device=device, fp8=fp8, dp=args.dp or world // (pp * ep), ep=ep,
        data_parallel=args.data_parallel if world > 1 else None, offload=args.offload,
        groups=args.groups, replicas=args.spare_slots, extra=tuple(extra),
    )  # fmt: skip


def rebalance(model, opt, step: int, trace) -> None:
    """Re-place experts (and their copies with --spare-slots): weights and optimizer state move
    together. The per-layer summary (copies per expert, largest / mean rank load before and
    after, slots moved, bytes sent) goes to the routing trace as rebalance records."""
    pipe = isinstance(model, PipelineRun)  # --pp: each stage's, {stage: report}
    trace.record_rebalance(
        step, model.rebalance(opt) if pipe else moe.parallel.rebalance_experts(model, opt)
    )


def run(argv: list[str] | None = None) -> dict:
    """The whole command; returns the summary (also written to <run-dir>/summary.json)."""
    args = parse_args(argv)
    with usage_errors():
        check_layout_args(args, sys.argv[1:] if argv is None else argv)
        cfg = resolve_config(args)
        if args.plan:
            return run_plan(args, cfg)
        device = resolve_device(args.device)
    rank, world, owns_group = init_distributed(args, device)
    try:
        with usage_errors():
            layout_auto(args, cfg, world, rank)  # --layout auto: moe.plan's top layout
        check_args(args, cfg, world)
        return train(args, cfg, rank, world, device)
    finally:
        if owns_group:
            dist.destroy_process_group()


def run_plan(args, cfg: M6Config) -> dict:
    world = args.world_size or (args.dp or 1) * (args.ep or 1)
    ep = args.ep or (world // args.dp if args.dp else default_ep(cfg, world))
    dp = args.dp or world // ep
    report = plan_report(
        cfg,
        world_size=world,
        dp=dp,
        ep=ep,
        dtype=args.dtype,
        offload=None if args.offload == "none" else args.offload,
        groups=args.groups,
        checkpointing=args.checkpointing,
        micro_batch_tokens=args.micro_batch_tokens,
        device_memory_bytes=int(args.device_memory_gb * 2**30) if args.device_memory_gb else None,
        data_parallel=args.data_parallel,
    )
    print(report)
    return {"config": cfg.name, "report": report}


def load_data(args, cfg: M6Config) -> tuple[m6data.Dataset, M6Config]:
    if args.data:
        data = m6data.load_folder(args.data, cfg.image_size, cfg.channels, seed=args.seed)
    else:
        if (cfg.image_size, cfg.channels) != (8, 1):
            raise UsageError(
                f"the digits data are 8x8 grey images; {cfg.name} expects "
                f"{cfg.image_size}x{cfg.image_size}x{cfg.channels}: pass --data DIR"
            )
        data = m6data.load_digits(seed=args.seed)
    if args.data:  # the vocabulary comes from the captions: size the embedding to it
        cfg = cfg.replace(vocab_size=-(-len(data.vocab) // 8) * 8)
    elif len(data.vocab) > cfg.vocab_size:
        raise UsageError(f"{cfg.name}: vocab_size {cfg.vocab_size} < {len(data.vocab)} words")
    return data, cfg


def train(args, cfg: M6Config, rank: int, world: int, device: torch.device) -> dict:
    """One run in its run directory, locked for the run's life (another run there is one
    error on every rank, before any work)."""
    out = run_dir(args, cfg)
    lock = rank0_then_all(lambda: _lock(out), world)
    try:
        return train_locked(args, cfg, rank, world, device, out)
    finally:
        if lock is not None:
            lock.release()


def _lock(out: Path) -> RunLock:
    lock = RunLock(out)
    lock.acquire()
    return lock


def train_locked(args, cfg: M6Config, rank: int, world: int, device, out: Path) -> dict:
    say = print if rank == 0 and not args.quiet else (lambda *a, **k: None)
    set_threads(args.threads, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    data, cfg = load_data(args, cfg)
    enc = m6data.encode(data.train, data.vocab, cfg.text_len)
    torch.manual_seed(args.seed)
    model = cfg.build().to(device)
    total, experts = count_params(model)
    if args.pp > 1:  # pipeline stages: this rank keeps its own (examples/m6/pipe.py)
        model, mesh = PipelineRun(model, cfg, args, world, device), None
    else:
        model, mesh = setup_parallel(model, args)
    opt = make_optimizer(model, args)
    history, start = new_history(cfg), 0
    args.schedule = lr_schedule.from_args(args)
    if args.resume:
        history, start = resume(out / "checkpoint", model, opt, cfg, data, args, say)
    else:
        start_fresh(out, rank, world, say)
    rt = Runtime(rank, world, device, mesh, autocast(args.precision, device))
    settings = run_settings(args, cfg, world, device)
    say(f"settings: {settings}")
    history["title"] = f"{cfg.name}: {settings}"  # the plots' titles name them
    # expert load per step and layer (moe.RoutingTrace), drawn into expert_load.png at the end;
    # read back at the metrics' log interval, so it adds no host sync of its own
    trace = open_trace(model, out / "routing_trace.jsonl", args, start)
    tokens_per_step = args.global_batch * cfg.seq_len
    say(
        f"{cfg.name}: {total:,} parameters ({experts:,} in experts), {cfg.active_params:,} active "
        f"per token; data {data.name}: {len(enc)} training examples, {len(data.test)} held-out "
        f"images; {world} rank(s) on {device}"
        + (f", {topology(world)}, all-to-all {args.alltoall}" if world > 1 else "")
    )
    if enc.truncated:
        say(f"note: {enc.truncated} targets cut to fit text_len={cfg.text_len}")
    eval_every = args.eval_every or max(args.steps // 10, 1)
    stop = args.stop_after or args.steps
    progress = Progress(start, args.steps, rank == 0 and not args.quiet)
    t0, done, eval_s = time.perf_counter(), 0, 0.0  # eval_s: held-out passes, not training
    model.train()
    log = MetricsLog()
    signals = StopOnSignal()
    syncs = SyncCounter(args.count_syncs, device)
    out_of_time, first_read = False, None  # first_read: (steps, seconds) at the first read-back
    with signals, syncs:
        for step in range(start, stop):
            log.append(train_step(model, opt, data, enc, step, args, rt))
            trace.step(step + 1)
            if args.rebalance_every and (step + 1) % args.rebalance_every == 0:
                # the trace's buffered steps first: their rank loads with the placement they
                # ran on (RoutingTrace maps experts to ranks when it writes)
                trace.flush()
                rebalance(model, opt, step + 1, trace)
            done += 1
            evaluate_now = (step + 1) % eval_every == 0 and step + 1 < args.steps
            save_now = args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop
            signalled = signals.signum is not None
            elapsed = time.perf_counter() - t0 - eval_s
            out_of_time = args.max_seconds is not None and elapsed >= args.max_seconds
            if not (
                out_of_time
                or (step + 1) % args.log_every == 0
                or step + 1 == stop
                or evaluate_now
                or save_now
                or (world == 1 and signalled)  # with ranks, the flag travels with the log
            ):
                continue  # nothing read back: the device runs ahead of the host
            records, stopping = log.flush(world, signalled)
            tok_s = done * tokens_per_step / (time.perf_counter() - t0 - eval_s)
            first_read = first_read or (done, time.perf_counter() - t0 - eval_s)
            _add_to_history(history, records, step, tok_s, args)
            m = records[-1]
            progress.update(
                step,
                f"loss {m['loss']:.3f} aux {m['aux']:.4f} {tok_s:,.0f} tok/s drop {100 * m['drop']:.1f}%",
                len(records),
            )
            if evaluate_now:
                t_eval = time.perf_counter()
                ev = evaluate(
                    for_eval(model),
                    data,
                    data.test,
                    cfg.text_len,
                    rt,
                    args.eval_batch,
                    generate=False,
                )
                history["eval_step"].append(step + 1)
                history["eval_loss"].append(ev["loss"])
                eval_s += time.perf_counter() - t_eval
            if save_now:
                save_step(
                    out / "checkpoint", model, opt, _state(step + 1, history, cfg, data, args)
                )
            if stopping:  # a signal on any rank: every rank saves this step, then stops
                progress.close()
                trace.close()
                ckpt = save_step(
                    out / "checkpoint", model, opt, _state(step + 1, history, cfg, data, args)
                )
                raise Interrupted(signals.signum or signal.SIGTERM, step + 1, ckpt)
            if out_of_time:  # --max-seconds: evaluate what was trained so far
                stop = step + 1
                break
    progress.close()
    trace.close()
    elapsed = time.perf_counter() - t0 - eval_s  # checkpoints included: they are training
    ckpt = save_step(out / "checkpoint", model, opt, _state(stop, history, cfg, data, args))
    summary = {
        "config": cfg.to_dict(), "world": world,
        "dp": (args.dp or world // (args.pp * (args.ep or 1))), "ep": args.ep or 1, "pp": args.pp, "device": str(device), "steps": stop, "steps_this_run": done,
        "time_s": elapsed, "tokens_per_s": done * tokens_per_step / elapsed if done else 0.0,
        "params": total, "active_params": cfg.active_params, "losses": history["loss"],
        "final_loss": history["loss"][-1],
        "host_syncs": syncs.count, "checkpoint": ckpt and str(ckpt), "out_of_time": out_of_time,
        "steady_tokens_per_s": _steady(first_read, done, elapsed, tokens_per_step),
        "settings": settings, "global_batch": args.global_batch,
        "layout": getattr(args, "auto_layout", None),
        "run_layout": run_layout(model, opt, args, cfg, world).record() if cfg.is_moe else None,
    }  # fmt: skip
    if stop < args.steps and not out_of_time:  # preempted on purpose: no evaluation
        say(f"stopped after step {stop}; checkpoint {ckpt} (continue with --resume)")
        return summary
    summary.update(final_evaluation(for_eval(model), data, cfg, args, rt, history))
    if rank == 0:
        if not args.no_plots:
            summary["plots"] = make_plots(history, data, summary, out)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary, say)
    return summary


def _steady(first_read, done: int, elapsed: float, tokens_per_step: int) -> float | None:
    """tokens/s after the first metrics read-back: without the first steps' kernel compiles."""
    if first_read is None or done <= first_read[0] or elapsed <= first_read[1]:
        return None
    return (done - first_read[0]) * tokens_per_step / (elapsed - first_read[1])


def _add_to_history(history: dict, records: list[dict], last: int, tok_s: float, args) -> None:
    """The metrics of the steps up to `last` (0-based) read at one log interval."""
    first = last + 1 - len(records)
    for i, m in enumerate(records):
        for key in ("loss", "aux", "drop"):
            history[key].append(m[key])
        history["step"].append(first + i + 1)
        history["lr"].append(lr_at(first + i, args))
        history["tokens_per_s"].append(tok_s)


def _state(step: int, history: dict, cfg: M6Config, data, args) -> dict:
    schedule = getattr(args, "schedule", None) or lr_schedule.from_args(args)
    return {"step": step, "history": history, "config": cfg.to_dict(), "vocab": data.vocab.words,
            "schedule": schedule.to_dict()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    try:
        run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
