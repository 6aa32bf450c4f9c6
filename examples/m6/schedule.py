"""The learning-rate schedule of an M6 run: linear warm-up, then cosine decay to 10% of the
peak. It is part of the run (saved in every checkpoint step), so `--resume --steps N` with
another total continues the learning rate the run was at (as Megatron's "use the checkpoint's
scheduler" does: past the saved total it stays at its 10% floor) instead of recomputing the
cosine for the new total, which jumped the LR of a finished run back up under its feet.
`--restart-schedule` starts a new warm-up + cosine at the resume step, over the steps left."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

FLOOR = 0.1  # the cosine ends at 10% of the peak


@dataclass(frozen=True)
class Schedule:
    """Peak `lr`, `warmup` steps, cosine to FLOOR x lr at step `steps`; step `start` is where
    the schedule (re)started (0 for a run's own)."""

    lr: float
    warmup: int
    steps: int
    start: int = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of the 0-based `step`: a pure function of it (resumable)."""
        s = step - self.start
        if s < self.warmup:
            return self.lr * (s + 1) / self.warmup
        t = (s - self.warmup) / max(self.steps - self.start - self.warmup, 1)
        return self.lr * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"peak lr {self.lr:g}, warm-up {self.warmup} steps from step {self.start}, cosine "
            f"to {FLOOR:.0%} at step {self.steps}"
        )


def from_args(args, start: int = 0) -> Schedule:
    return Schedule(lr=args.lr, warmup=args.warmup, steps=args.steps, start=start)


def check(saved) -> Schedule:
    """The checkpoint's schedule (untrusted JSON): a ValueError naming the bad field."""
    if not isinstance(saved, dict) or set(saved) != {"lr", "warmup", "steps", "start"}:
        raise ValueError("training state: field 'schedule' must hold lr, warmup, steps, start")
    lr = saved["lr"]
    if (
        not isinstance(lr, (int, float))
        or isinstance(lr, bool)
        or not (math.isfinite(lr) and lr > 0)
    ):
        raise ValueError(
            f"training state: field 'schedule.lr' must be a finite number > 0, got {lr!r}"
        )
    for key, low in (("warmup", 0), ("steps", 1), ("start", 0)):
        v = saved[key]
        if type(v) is not int or v < low:
            raise ValueError(f"training state: field 'schedule.{key}' must be an integer >= {low}")
    return Schedule(float(lr), saved["warmup"], saved["steps"], saved["start"])


def on_resume(saved: dict | None, start: int, args) -> tuple[Schedule, str]:
    """(the schedule a resumed run follows, the line saying which)."""
    if args.restart_schedule:
        new = from_args(args, start)
        return (
            new,
            f"learning rate: schedule restarted at step {start} (--restart-schedule): {new.describe()}",
        )
    if saved is None:  # a checkpoint older than the saved schedule
        new = from_args(args)
        return new, (
            f"learning rate: the checkpoint has no saved schedule; following this command's "
            f"({new.describe()})"
        )
    old = check(saved)
    line = (
        f"learning rate: continuing the checkpoint's schedule ({old.describe()}), "
        f"{old.lr_at(start):.3g} at step {start}"
    )
    if (old.lr, old.warmup, old.steps) != (args.lr, args.warmup, args.steps):
        held = f", held at its floor past step {old.steps}" if args.steps > old.steps else ""
        line += (
            f"{held}; this command's --steps/--lr/--warmup do not change it (--restart-schedule "
            "starts a new one here)"
        )
    return old, line
