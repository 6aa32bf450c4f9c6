"""Train the M6-style multimodal MoE model: one command from a laptop CPU to DP x EP.

    python examples/m6/train.py                          # tiny config, digits, CPU, about a minute
    python examples/m6/train.py --resume --steps 800     # continue from runs/m6-tiny/checkpoint
    python examples/m6/train.py --dense                  # dense baseline at equal active FLOPs
    torchrun --nproc-per-node 4 examples/m6/train.py --dp 2 --ep 2
    python examples/m6/train.py --config m6-1t --plan --world-size 480 --device-memory-gb 32

Loss convention (what makes 1 rank and N ranks agree): every rank takes a contiguous
1/world shard of the same global batch; its loss is its summed token cross-entropy times
world / (target tokens in the global batch), plus each micro-batch's aux loss / micro-batches.
Gradients averaged over ranks are then exactly the gradients of the global-batch mean.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples.m6` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import moe  # noqa: E402
import moe.parallel  # noqa: E402
from examples.m6 import data as m6data  # noqa: E402
from examples.m6.config import M6Config, get_config  # noqa: E402
from examples.m6.evaluate import evaluate  # noqa: E402
from examples.m6.model import count_params  # noqa: E402
from examples.m6.plan import check_layout, default_ep, plan_report  # noqa: E402
from examples.m6.runtime import Runtime  # noqa: E402


class UsageError(ValueError):
    """A bad command line, reported before any work starts."""


@contextmanager
def usage_errors():
    """Config and layout validation errors are the user's: report them as UsageError."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from e


# -- arguments ----------------------------------------------------------------------------
def _capacity(text: str) -> float | None:
    return None if text.lower() in ("none", "dropless") else float(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("model")
    g.add_argument("--config", default="m6-tiny", help="m6-tiny, m6-base, m6-10b, m6-100b, m6-1t")
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
    g = p.add_argument_group("data and training")
    g.add_argument("--data", help="folder with captions.jsonl (default: scikit-learn digits)")
    g.add_argument("--steps", type=int, default=500)
    g.add_argument("--global-batch", type=int, default=64, help="examples per step, all ranks")
    g.add_argument("--micro-batch", type=int, help="examples per forward per rank (default: all)")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=int, default=30)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto, cpu, cuda")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    g.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU intra-op threads (0: torch's default); the tiny model's matrices "
        "are too small for more threads to pay, they only contend",
    )
    g = p.add_argument_group("outputs")
    g.add_argument("--run-dir", help="default runs/<config>")
    g.add_argument("--resume", action="store_true", help="continue from <run-dir>/checkpoint")
    g.add_argument("--save-every", type=int, default=0, help="also checkpoint every n steps")
    g.add_argument(
        "--stop-after", type=int, help="stop (and checkpoint) after this step, as if preempted"
    )
    g.add_argument("--eval-every", type=int, help="held-out loss every n steps (default steps/10)")
    g.add_argument("--eval-batch", type=int, default=256)
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    g = p.add_argument_group("parallelism (under torchrun)")
    g.add_argument("--dp", type=int, help="data-parallel size (default world / ep)")
    g.add_argument("--ep", type=int, help="expert-parallel size (default 1)")
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
    g.add_argument("--offload", choices=("none", "optimizer", "all"), default="none")
    g.add_argument("--checkpointing", action="store_true", help="recompute blocks in backward")
    g = p.add_argument_group("memory plan (meta device, no allocation)")
    g.add_argument("--plan", action="store_true", help="print parameter counts and the memory plan")
    g.add_argument("--world-size", type=int, help="devices of the planned cluster")
    g.add_argument(
        "--device-memory-gb", type=float, help="per device, in GiB (a '32 GB' V100 has 32 GiB)"
    )
    g.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    g.add_argument("--micro-batch-tokens", type=int)
    return p.parse_args(argv)


def resolve_config(args) -> M6Config:
    """The named config with the command line's overrides."""
    cfg = get_config(args.config)
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
    cfg = cfg.replace(**changes) if changes else cfg
    return cfg.equal_flops_dense() if args.dense else cfg


def check_args(args, cfg: M6Config, world: int) -> None:
    """Every error we can find before building anything."""
    ep = args.ep or 1
    dp = args.dp or max(world // ep, 1)
    if world == 1 and dp * ep > 1:
        raise UsageError(
            f"--dp {dp} --ep {ep} needs {dp * ep} processes: launch with "
            f"torchrun --nproc-per-node {dp * ep} examples/m6/train.py ..."
        )
    if world > 1:
        with usage_errors():
            check_layout(cfg, world, dp, ep)
    if args.ep and args.ep > 1 and not cfg.is_moe:
        raise UsageError(f"--ep {args.ep} needs an MoE model; {cfg.name} is dense")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.stop_after is not None and not 0 < args.stop_after < args.steps:
        raise UsageError(
            f"--stop-after must be in (0, --steps={args.steps}), got {args.stop_after}"
        )
    if args.global_batch < 1 or args.global_batch % world:
        raise UsageError(
            f"--global-batch {args.global_batch} must be a positive multiple of the {world} ranks"
        )
    per_rank = args.global_batch // world
    micro = args.micro_batch or per_rank
    if micro < 1 or per_rank % micro:
        raise UsageError(f"--micro-batch {micro} must divide the per-rank batch {per_rank}")
    if args.groups < 1:
        raise UsageError(f"--groups must be >= 1, got {args.groups}")
    if args.resume and not (run_dir(args, cfg) / "checkpoint" / "state.json").is_file():
        raise UsageError(f"--resume: no checkpoint in {run_dir(args, cfg) / 'checkpoint'}")


def run_dir(args, cfg: M6Config) -> Path:
    return Path(args.run_dir or Path("runs") / cfg.name)


# -- distributed pieces (each one call into moe.parallel) ------------------------------------
def init_distributed(args) -> tuple[int, int, bool]:
    """(rank, world, whether we initialised the process group) from torchrun's variables."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, False
    cuda = torch.cuda.is_available() and args.device != "cpu"
    # A collective timeout: a dead or stuck rank becomes an error on the others, not a hang.
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return dist.get_rank(), world, True


def pick_device(args) -> torch.device:
    if args.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(args.device)


def topology(world: int) -> str:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(world // max(local, 1), 1)
    return f"{nodes} node(s) x {local} rank(s)"


def setup_parallel(model, args):
    """(model, mesh): MoE models get experts sharded over "ep" and gradients reduced in
    backward by moe.parallel; a dense model on several ranks (the baseline) is plain
    DistributedDataParallel (mesh None); one process: (model, None). Activation
    checkpointing either way when --checkpointing."""
    mesh = None
    if _world() > 1 and moe.moe_layers(model):
        ep = args.ep or 1
        mesh = moe.parallel.init_mesh(dp=args.dp or _world() // ep, ep=ep)
        model = (
            moe.parallel.parallelize(model, mesh, args.data_parallel, algorithm=args.alltoall)
            or model
        )
    if args.checkpointing:
        moe.parallel.auto_checkpoint(model)
    if _world() > 1 and mesh is None:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, mesh


def unwrap(model):
    """The model itself, without a DistributedDataParallel wrapper."""
    return getattr(model, "module", model)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def make_optimizer(model, args):
    """AdamW; through moe.parallel.GroupedApply for --groups > 1 or --offload (Whale)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": args.weight_decay}
    if args.groups > 1 or args.offload != "none":
        offload = None if args.offload == "none" else args.offload
        return moe.parallel.GroupedApply(
            params, torch.optim.AdamW, groups=args.groups, offload=offload, **kwargs
        )
    return torch.optim.AdamW(params, **kwargs)


def clip_gradients(model, opt, args, mesh) -> None:
    """Global gradient-norm clipping (experts counted once, not once per replica)."""
    if args.clip <= 0:
        return
    grouped = isinstance(opt, moe.parallel.GroupedApply)
    moe.parallel.clip_grad_norm_(model, args.clip, mesh=mesh, optimizer=opt if grouped else None)


def save(ckpt_dir: Path, model, opt, state: dict) -> Path:
    """Weights + optimizer via moe.parallel.save_checkpoint (experts by global id: resumable
    at any EP size, no pickles) and the training state (step, history) as JSON."""
    model, world = unwrap(model), _world()
    rank = dist.get_rank() if world > 1 else 0
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    if world > 1:
        dist.barrier()
    moe.parallel.save_checkpoint(
        str(ckpt_dir / "weights"), model, opt, extra={"step": state["step"]}
    )
    if world == 1:  # noisy routers draw random numbers: resume them too
        state = dict(state, rng=torch.get_rng_state().tolist())
    if rank == 0:
        (ckpt_dir / "state.json.tmp").write_text(json.dumps(state))
        os.replace(ckpt_dir / "state.json.tmp", ckpt_dir / "state.json")
    if world > 1:
        dist.barrier()
    return ckpt_dir


def load(ckpt_dir: Path, model, opt) -> dict:
    """Restore what `save` wrote; returns the training state."""
    model, world = unwrap(model), _world()
    state = json.loads((ckpt_dir / "state.json").read_text())
    extra = moe.parallel.load_checkpoint(str(ckpt_dir / "weights"), model, opt)
    if extra.get("step") != state["step"]:
        raise UsageError(
            f"{ckpt_dir}: weights of step {extra.get('step')}, state of {state['step']}"
        )
    if world == 1 and "rng" in state:
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
    return state


# -- training -----------------------------------------------------------------------------
def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10%: a pure function of the step (resumable)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class Progress:
    """tqdm when installed, else a printed line every ~5% of the run."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.enabled, self.total, self.bar = enabled, total, None
        self.every = max(total // 20, 1)
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif (step + 1) % self.every == 0 or step + 1 == self.total:
            print(f"step {step + 1}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def new_history(cfg: M6Config) -> dict:
    return {
        "title": cfg.name, "step": [], "loss": [], "aux": [], "drop": [], "lr": [],
        "tokens_per_s": [], "eval_step": [], "eval_loss": [],
        "load": {name: [] for name in cfg.moe_block_names()},
    }  # fmt: skip


def train_step(model, opt, data, enc, step: int, args, rt: Runtime) -> dict:
    """One optimizer step over this rank's shard of the global batch; global metrics."""
    world = rt.world
    global_idx = m6data.global_batch_indices(step, len(enc), args.global_batch, args.seed)
    global_targets = int((enc.labels_NL[global_idx] != m6data.IGNORE).sum())
    local_idx = m6data.shard(global_idx, rt.rank, world)
    micro = local_idx.split(args.micro_batch or local_idx.shape[0])
    for group in opt.param_groups:
        group["lr"] = lr_at(step, args)
    opt.zero_grad(set_to_none=True)
    layers = moe.moe_layers(model)
    sums = torch.zeros(4, dtype=torch.float64)  # ce sum, aux mean share, dropped, routed pairs
    load = {name: 0 for name, _ in layers}
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
        aux = moe.aux_loss(model).to(ce.device)
        (ce * (world / global_targets) + aux / len(micro)).backward()
        sums[0] += ce.item()
        sums[1] += aux.item() / len(micro)
        for name, layer in layers:
            s = layer.stats
            sums[2] += float(s["dropped"])
            routed_E = s["routed_per_expert"].double().cpu()
            sums[3] += float(routed_E.sum())
            load[name] = load[name] + routed_E
    clip_gradients(model, opt, args, rt.mesh)
    opt.step()
    moe.update_router_biases(model)
    if world > 1:
        packed = torch.cat([sums] + [load[n] for n, _ in layers])
        dist.all_reduce(packed)
        sums, offset = packed[:4], 4
        for name, _ in layers:
            E = load[name].numel()
            load[name], offset = packed[offset : offset + E], offset + E
    return {
        "loss": float(sums[0]) / global_targets,
        "aux": float(sums[1]) / world,
        "drop": float(sums[2] / sums[3]) if sums[3] else 0.0,
        "load": {name: (v / v.sum().clamp_min(1)).tolist() for name, v in load.items()},
    }


def run(argv: list[str] | None = None) -> dict:
    """The whole command; returns the summary (also written to <run-dir>/summary.json)."""
    args = parse_args(argv)
    with usage_errors():
        cfg = resolve_config(args)
        if args.plan:
            return run_plan(args, cfg)
    rank, world, owns_group = init_distributed(args)
    try:
        check_args(args, cfg, world)
        return train(args, cfg, rank, world)
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


def train(args, cfg: M6Config, rank: int, world: int) -> dict:
    out = run_dir(args, cfg)
    say = print if rank == 0 and not args.quiet else (lambda *a, **k: None)
    device = pick_device(args)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    data, cfg = load_data(args, cfg)
    enc = m6data.encode(data.train, data.vocab, cfg.text_len)
    torch.manual_seed(args.seed)
    model = cfg.build().to(device)
    total, experts = count_params(model)
    model, mesh = setup_parallel(model, args)
    opt = make_optimizer(model, args)
    history, start = new_history(cfg), 0
    if args.resume:
        state = load(out / "checkpoint", model, opt)
        if state["config"] != cfg.to_dict() or state["vocab"] != data.vocab.words:
            raise UsageError(
                f"--resume: {out / 'checkpoint'} holds a different config or vocabulary"
            )
        history, start = state["history"], state["step"]
        if start >= args.steps:
            raise UsageError(f"--resume: the checkpoint is at step {start}; pass --steps > {start}")
    rt = Runtime(rank, world, device, mesh, autocast)
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
    for step in range(start, stop):
        m = train_step(model, opt, data, enc, step, args, rt)
        done += 1
        tok_s = done * tokens_per_step / (time.perf_counter() - t0 - eval_s)
        for key in ("loss", "aux", "drop"):
            history[key].append(m[key])
        history["step"].append(step + 1)
        history["lr"].append(lr_at(step, args))
        history["tokens_per_s"].append(tok_s)
        for name, share in m["load"].items():
            history["load"][name].append(share)
        progress.update(
            step,
            f"loss {m['loss']:.3f} aux {m['aux']:.4f} {tok_s:,.0f} tok/s drop {100 * m['drop']:.1f}%",
        )
        if (step + 1) % eval_every == 0 and step + 1 < args.steps:
            t_eval = time.perf_counter()
            ev = evaluate(model, data, data.test, cfg.text_len, rt, args.eval_batch, generate=False)
            history["eval_step"].append(step + 1)
            history["eval_loss"].append(ev["loss"])
            eval_s += time.perf_counter() - t_eval
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < stop:
            save(out / "checkpoint", model, opt, _state(step + 1, history, cfg, data))
    progress.close()
    elapsed = time.perf_counter() - t0 - eval_s  # checkpoints included: they are training
    ckpt = save(out / "checkpoint", model, opt, _state(stop, history, cfg, data))
    summary = {
        "config": cfg.to_dict(), "world": world, "dp": (args.dp or world // (args.ep or 1)),
        "ep": args.ep or 1, "device": str(device), "steps": stop, "steps_this_run": done,
        "time_s": elapsed, "tokens_per_s": done * tokens_per_step / elapsed if done else 0.0,
        "params": total, "active_params": cfg.active_params, "losses": history["loss"],
        "final_loss": history["loss"][-1], "checkpoint": str(ckpt),
    }  # fmt: skip
    if stop < args.steps:  # preempted on purpose: no evaluation
        say(f"stopped after step {stop}; checkpoint {ckpt} (continue with --resume)")
        return summary
    summary.update(final_evaluation(model, data, cfg, args, rt, history))
    if rank == 0:
        if not args.no_plots:
            summary["plots"] = make_plots(history, data, summary, out)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary, say)
    return summary


def _state(step: int, history: dict, cfg: M6Config, data) -> dict:
    return {"step": step, "history": history, "config": cfg.to_dict(), "vocab": data.vocab.words}


def final_evaluation(model, data, cfg, args, rt: Runtime, history) -> dict:
    """Caption accuracy on held-out images, text-to-text accuracy, sample generations."""
    caption = evaluate(model, data, data.test, cfg.text_len, rt, args.eval_batch)
    text = evaluate(model, data, data.text_pairs, cfg.text_len, rt, args.eval_batch)
    history["eval_step"].append(args.steps)
    history["eval_loss"].append(caption["loss"])
    samples = [
        {
            "image": data.test[s["example"]].image,
            "label": data.labels[data.test[s["example"]].image] if data.labels else None,
            "prompt": data.test[s["example"]].prompt,
            "generated": s["generated"],
            "reference": data.test[s["example"]].target,
            "correct": s["correct"],
        }
        for s in caption["samples"]
    ]
    text_samples = [
        {
            "prompt": data.text_pairs[s["example"]].prompt,
            "generated": s["generated"],
            "correct": s["correct"],
        }
        for s in text["samples"][:4]
    ]
    return {
        "caption_accuracy": caption["accuracy"], "caption_correct": caption["correct"],
        "caption_total": caption["total"], "heldout_loss": caption["loss"],
        "text_accuracy": text["accuracy"], "samples": samples, "text_samples": text_samples,
    }  # fmt: skip


def make_plots(history, data, summary, out: Path) -> list[str]:
    from examples.m6 import plots

    paths = [
        plots.plot_loss(history, out / "loss.png"),
        plots.plot_expert_load(history, out / "expert_load.png"),
    ]
    samples = summary["samples"]
    if samples:
        images = data.images_NCHW[[s["image"] for s in samples]]
        titles = [("ok: " if s["correct"] else "WRONG: ") + s["generated"] for s in samples]
        paths.append(plots.plot_samples(images, titles, out / "samples.png"))
    return [str(p) for p in paths if p is not None]


def print_summary(s: dict, say) -> None:
    chance = " (chance 10%)" if s["config"]["name"].startswith("m6-tiny") else ""
    say(
        f"\n{s['config']['name']}: {s['steps_this_run']} steps in {s['time_s']:.1f} s, "
        f"{s['tokens_per_s']:,.0f} tokens/s on {s['world']} rank(s) ({s['device']}); "
        f"final train loss {s['final_loss']:.4f}"
    )
    say(
        f"held-out caption accuracy {100 * s['caption_accuracy']:.1f}% "
        f"({s['caption_correct']}/{s['caption_total']}){chance}; held-out loss "
        f"{s['heldout_loss']:.4f}; text-to-text accuracy {100 * s['text_accuracy']:.1f}%"
    )
    say("sample captions (held-out images):")
    for x in s["samples"]:
        label = f"[{x['label']}] " if x["label"] else ""
        say(f"  {label}{x['prompt']} -> {x['generated']!r} {'ok' if x['correct'] else 'WRONG'}")
    for x in s["text_samples"]:
        say(f"  {x['prompt']} -> {x['generated']!r} {'ok' if x['correct'] else 'WRONG'}")
    for path in s.get("plots", []):
        say(f"plot: {path}")
    say(f"checkpoint: {s['checkpoint']} (continue with --resume --steps N)")


def main(argv: list[str] | None = None) -> int:
    try:
        run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
