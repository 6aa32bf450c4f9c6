"""Fine-tune a tiny multimodal MoE model of a real transformers family (Qwen3-VL-MoE: a vision
tower and an MoE language model) to caption scikit-learn's digits, with moe's layers.

    python examples/hf/multimodal.py                  # 600 steps on the CPU: 32 s of CPU time
    python examples/hf/multimodal.py --resume --steps 800   # continue from the checkpoint
    torchrun --nproc-per-node 2 examples/hf/multimodal.py --ep 2   # experts over 2 ranks

Steps: transformers' Qwen3VLMoeForConditionalGeneration built from its config class (random
weights, nothing downloaded) -> moe.from_hf (its MoE blocks through transformers' experts
contract: the family's router kept, moe's dispatch and experts behind it) -> optionally
moe.parallel.parallelize over (dp, ep) -> train on image + caption batches (examples/hf/
digits_vl.py) -> the held-out images' captions generated greedily: the caption accuracy
against chance (10 %: one digit word in ten), a plot of loss and accuracy (<out>/multimodal.png).

<out>/checkpoint holds the newest checkpoint (moe.checkpoint: model, optimizer, the step and
history), saved every --save-every steps and at the end; a save is published atomically, so
a kill leaves the previous one. SIGTERM or SIGINT finishes the step (under torchrun: the steps
up to the next --log-every read), saves and exits with 128 + the signal's number; --resume
continues from the checkpoint. A fresh run replaces an earlier run's checkpoint at its first
save.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `moe` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import moe  # noqa: E402
from examples.device import add_device_args, autocast, resolve_device, threads_problem  # noqa: E402
from examples.hf import digits_vl  # noqa: E402
from examples.hf.finetune import _layout_problem, out_problem, start  # noqa: E402
from examples.m6 import schedule as lr_schedule  # noqa: E402
from examples.m6.data import shard  # noqa: E402
from examples.m6.signals import Interrupted, StopOnSignal  # noqa: E402
from examples.settings import settings_line  # noqa: E402
from moe.checkpoint import CheckpointError, CheckpointNotFoundError  # noqa: E402

CHANCE = 0.1  # one digit word in ten
SAME_MATH = (
    "batch",
    "lr",
    "warmup",
    "seed",
)  # a resumed run must keep these (its data and updates)


class UsageError(ValueError):
    """A bad command line: one `error: ...` line, exit status 2, before any work."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors as one line too
        raise UsageError(message)


@dataclass(frozen=True)
class Settings:
    """The command line, checked (`problem`)."""

    out: str = "runs/hf-multimodal"
    steps: int = 600
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    log_every: int = 50
    eval_every: int = 100
    save_every: int = 100
    stop_after: int | None = None
    resume: bool = False
    plot: bool = True
    quiet: bool = False
    ep: int = 1
    device: str = "auto"
    precision: str = "auto"
    threads: int = 1

    def problem(self, world: int) -> str | None:
        """Why these settings cannot run on `world` ranks (one line), or None."""
        for name in ("steps", "batch", "log_every", "eval_every"):
            if getattr(self, name) < 1:
                return f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
        if self.warmup < 0:
            return f"--warmup must be >= 0, got {self.warmup}"
        if self.save_every < 0:
            return f"--save-every must be >= 0 (0: only at the end), got {self.save_every}"
        if not (math.isfinite(self.lr) and self.lr > 0):
            return f"--lr must be a finite number > 0, got {self.lr}"
        if self.stop_after is not None and not 0 < self.stop_after < self.steps:
            return f"--stop-after must be in (0, --steps={self.steps}), got {self.stop_after}"
        return (
            threads_problem(self.threads) or _layout_problem(self, world) or out_problem(self.out)
        )


def parse_args(argv=None) -> Settings:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=Settings.out, help="run folder: checkpoint/, the plot")
    p.add_argument("--steps", type=int, default=Settings.steps, help="training steps in all")
    p.add_argument("--batch", type=int, default=Settings.batch, help="examples per step, all ranks")
    p.add_argument("--lr", type=float, default=Settings.lr, help="peak learning rate (AdamW)")
    p.add_argument(
        "--warmup", type=int, default=Settings.warmup, help="linear warm-up, then cosine to 10%%"
    )
    p.add_argument("--seed", type=int, default=Settings.seed, help="weights and data order")
    p.add_argument(
        "--log-every", type=int, default=Settings.log_every, help="read the loss every n steps"
    )
    p.add_argument(
        "--eval-every", type=int, default=Settings.eval_every, help="held-out accuracy every n"
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=Settings.save_every,
        help="checkpoint every n (0: at the end)",
    )
    p.add_argument("--stop-after", type=int, help="stop (and checkpoint) here, as if preempted")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="write no plot")
    p.add_argument("--ep", type=int, default=Settings.ep, help="expert-parallel size (torchrun)")
    p.add_argument("--quiet", action="store_true")
    add_device_args(p)
    args = vars(p.parse_args(argv))
    settings = Settings(**{f.name: args[f.name] for f in fields(Settings)})
    problem = settings.problem(int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        raise UsageError(problem)
    try:
        resolve_device(settings.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return settings


def check_state(state, s: Settings) -> None:
    """The checkpoint's own state (untrusted JSON): a ValueError naming the first bad field."""
    history = state.get("history") if isinstance(state, dict) else None
    if not isinstance(history, dict) or type(state.get("step")) is not int:
        raise ValueError("training state: needs an integer 'step' and a 'history' object")
    for key in ("step", "loss", "eval_step", "accuracy", "resume_step"):
        values = history.get(key)
        if not isinstance(values, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            raise ValueError(f"training state: history.{key} must be a list of numbers")
    for x, y in (("step", "loss"), ("eval_step", "accuracy")):
        if len(history[x]) != len(history[y]):
            raise ValueError(f"training state: history.{y} must have one entry per {x}")
    saved = state.get("settings")
    if not isinstance(saved, dict):
        raise ValueError("training state: 'settings' must be an object")
    differ = [f"--{k} {saved.get(k)!r} there, {getattr(s, k)!r} now" for k in SAME_MATH
              if saved.get(k) != getattr(s, k)]  # fmt: skip
    if differ:
        raise ValueError(f"trained with other settings ({'; '.join(differ)}): pass the same")
    lr_schedule.check(state.get("schedule"))
    if state["step"] >= s.steps:
        raise ValueError(f"the checkpoint is at step {state['step']}; pass --steps > it")


def save(folder: Path, model, opt, step: int, history: dict, schedule, s: Settings) -> Path:
    """Collective: model, optimizer, step, history and schedule, published atomically."""
    state = {"step": step, "history": history, "schedule": schedule.to_dict(),
             "settings": {k: getattr(s, k) for k in SAME_MATH}}  # fmt: skip
    return Path(moe.checkpoint.save_checkpoint(str(folder), model, opt, extra=state))


def resume(folder: Path, model, opt, s: Settings, say) -> tuple[dict, int, lr_schedule.Schedule]:
    """Load the newest checkpoint under `folder`: (history, step, the run's schedule: a
    longer --steps holds the learning rate at its floor past the saved end, as M6 does)."""
    try:
        state = moe.checkpoint.load_checkpoint(
            str(folder), model, opt, check_extra=lambda extra: check_state(extra, s)
        )
    except CheckpointNotFoundError as e:
        raise UsageError(f"--resume: {e}") from None
    except CheckpointError as e:
        raise UsageError(f"--resume: {folder}: {' '.join(str(e).split())}") from None
    step, history = state["step"], state["history"]
    history["resume_step"].append(step)
    say(f"resuming from step {step} ({moe.checkpoint.checkpoint_dir(str(folder))})")
    return history, step, lr_schedule.check(state["schedule"])


def train_step(model, opt, data, step: int, lr: float, s: Settings, rank, world, device):
    """One optimizer step at `lr` on this rank's share of `step`'s batch; the loss (on device)."""
    for group in opt.param_groups:
        group["lr"] = lr
    idx = shard(digits_vl.batch_indices(data, step, s.batch, s.seed), rank, world)
    with autocast(s.precision, device):
        loss = digits_vl.caption_loss(model, data, idx, device) + moe.aux_loss(model)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach().float()


def accuracy(model, data, device, s: Settings) -> float:
    """Share of held-out images whose generated caption is exactly right."""
    model.eval()
    with autocast(s.precision, device):
        got = digits_vl.greedy_captions(model, data, device)
    model.train()
    return sum(g == w for g, w in zip(got, data.test_captions)) / len(got)


def run(argv=None) -> dict:
    """The whole command; returns the result (losses, accuracies, paths)."""
    s = parse_args(argv)
    device = resolve_device(s.device)
    world, rank, say = start(_Namespace(s, device))
    t0 = time.perf_counter()
    data = digits_vl.load(seed=s.seed)
    model = digits_vl.tiny_qwen3_vl_moe(len(data.vocab) + 1, data.image_token).float()
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.visual.parameters())
    moe.from_hf(model)  # the MoE blocks through the experts contract; the vision tower as is
    model.to(device)
    if world > 1:
        moe.parallel.parallelize(model, moe.parallel.init_mesh(dp=world // s.ep, ep=s.ep))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    folder = Path(s.out) / "checkpoint"
    history = {"step": [], "loss": [], "eval_step": [], "accuracy": [], "resume_step": []}
    schedule = lr_schedule.Schedule(lr=s.lr, warmup=s.warmup, steps=s.steps)
    if s.resume:
        history, first, schedule = resume(folder, model, opt, s, say)
    else:
        first = 0
    if not s.resume and os.path.lexists(folder / "LATEST"):
        say(f"note: {folder} holds an earlier run; this run replaces it at its first save")
    settings = settings_line(
        precision=s.precision, device=device, dp=world // s.ep, ep=s.ep,
        data_parallel="ddp" if world > 1 else None,
    )  # fmt: skip
    say(f"settings: {settings}")
    say(
        f"Qwen3-VL-MoE (tiny, random init): {total:,} parameters ({vision:,} in the vision "
        f"tower); {len(data.train)} training images, {len(data.test)} held out"
    )
    stop = s.stop_after or s.steps
    if first == 0:  # the random model's accuracy: chance
        history["eval_step"].append(0)
        history["accuracy"].append(accuracy(model, data, device, s))
        say(f"step 0: held-out caption accuracy {100 * history['accuracy'][-1]:.1f}%")
    pending, ckpt = [], None
    with StopOnSignal() as signals:
        for step in range(first, stop):
            lr = schedule.lr_at(step)
            pending.append(train_step(model, opt, data, step, lr, s, rank, world, device))
            done = step + 1
            read = done % s.log_every == 0 or done == stop
            stopping = _signalled(signals, world, device) if world == 1 or read else False
            if read:
                _read(history, pending, done, world)
                say(f"step {done}/{s.steps} loss {history['loss'][-1]:.3f}")
            if done % s.eval_every == 0 and done < s.steps:
                history["eval_step"].append(done)
                history["accuracy"].append(accuracy(model, data, device, s))
                say(f"step {done}: held-out caption accuracy {100 * history['accuracy'][-1]:.1f}%")
            if stopping or done == stop or (s.save_every and done % s.save_every == 0):
                _read(history, pending, done, world)  # the saved history has every step's loss
                ckpt = save(folder, model, opt, done, history, schedule, s)
            if stopping:
                raise Interrupted(signals.signum or signal.SIGTERM, done, ckpt)
    result = {"losses": history["loss"], "steps": stop, "checkpoint": str(ckpt),
              "settings": settings, "history": history}  # fmt: skip
    if stop < s.steps:
        say(f"stopped after step {stop}; checkpoint {ckpt} (continue with --resume)")
        return result
    history["eval_step"].append(stop)
    history["accuracy"].append(accuracy(model, data, device, s))
    result["accuracy"], result["seconds"] = history["accuracy"][-1], time.perf_counter() - t0
    right = round(result["accuracy"] * len(data.test))
    if rank == 0 and s.plot:
        result["plot"] = str(plot(history, Path(s.out) / "multimodal.png", settings))
    say(
        f"held-out caption accuracy {100 * result['accuracy']:.1f}% ({right}/{len(data.test)}; "
        f"chance {100 * CHANCE:.0f}%) after {stop} steps, {result['seconds']:.0f} s; "
        f"checkpoint {ckpt}" + (f"; plot {result['plot']}" if "plot" in result else "")
    )
    if world > 1:
        dist.barrier()
    return result


def _signalled(signals: StopOnSignal, world: int, device) -> bool:
    """Whether any rank was signalled (every rank stops after the same step: with ranks, asked
    at the loss reads only, which read back anyway)."""
    flag = torch.tensor([float(signals.signum is not None)], device=device)
    if world > 1:
        dist.all_reduce(flag)
    return bool(flag.item())


def _read(history: dict, pending: list, done: int, world: int) -> None:
    """Move the losses of the steps up to `done` not read yet into the history (one read; with
    ranks, the mean of theirs: the global batch's loss)."""
    if pending:
        losses = torch.stack(pending)
        if world > 1:
            dist.all_reduce(losses)
            losses /= world
        history["step"] += list(range(done - len(pending) + 1, done + 1))
        history["loss"] += losses.cpu().tolist()
        pending.clear()


class _Namespace:
    """finetune.start's view of the settings (the device resolved)."""

    def __init__(self, s: Settings, device):
        self.__dict__.update(asdict(s), device=device)


def plot(history: dict, path: Path, title: str) -> Path:
    """Training loss and held-out caption accuracy against step (chance dotted)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    ax.plot(history["step"], history["loss"], lw=1, label="train loss (caption tokens)")
    ax.set_yscale("log")
    ax.set_ylabel("cross-entropy / token")
    ax2.plot(history["eval_step"], [100 * a for a in history["accuracy"]], "o-",
             label="held-out caption accuracy")  # fmt: skip
    ax2.axhline(100 * CHANCE, color="0.4", ls=":", label="chance (10 %)")
    ax2.set_ylabel("%")
    ax2.set_ylim(0, 100)
    ax2.set_xlabel("step")
    for a in (ax, ax2):
        for resumed in history["resume_step"]:
            a.axvline(resumed, color="0.4", ls="--", lw=1, label=f"resumed at step {resumed}")
        a.grid(alpha=0.3)
        a.legend(loc="best", fontsize=8)
    fig.suptitle(f"Qwen3-VL-MoE (tiny) on digits with moe: {title}", fontsize=8, wrap=True)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    try:
        run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
