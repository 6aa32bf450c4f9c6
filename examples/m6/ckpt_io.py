"""Checkpoint steps of an M6 run: each step is one moe.checkpoint folder.

    <run-dir>/checkpoint/step-00000120/   moe.checkpoint.save_checkpoint's folder (LATEST,
                                          ckpt-<id>/): model + optimizer, and the training
                                          state (step, history, config, vocabulary, + RNG) as
                                          the checkpoint's JSON `extra`

moe.checkpoint publishes a save atomically (one rename and LATEST), so a kill at any moment
leaves a step folder either complete (it has LATEST) or without a checkpoint, and a step saved
again keeps its previous checkpoint until the new one is published. Resume takes the newest
step that loads, its training state checked (`check_state`) before any weight is touched,
falling back to older ones. After each save, rank 0 keeps the newest `KEEP` complete steps and
removes step folders a killed save left without a checkpoint.
"""

from __future__ import annotations

import shutil
from dataclasses import MISSING, fields
from pathlib import Path

import torch
import torch.distributed as dist

import moe.checkpoint
from examples.m6 import schedule as lr_schedule
from examples.m6.cli import RunError, UsageError
from examples.m6.config import M6Config
from examples.m6.run_folder import RunFolderError, set_aside
from examples.m6.setup import unwrap
from moe.checkpoint import CheckpointError, CheckpointNotFoundError

KEEP = 2
PREFIX = "step-"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """Every `step-N` folder under `root`, newest first."""
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        number = path.name.removeprefix(PREFIX)
        if path.name.startswith(PREFIX) and number.isdigit() and path.is_dir():
            steps.append((int(number), path))
    return sorted(steps, reverse=True)


def _has_checkpoint(path: Path) -> bool:
    """True when a save into `path` was published (a damaged LATEST counts: loading reports it)."""
    try:
        moe.checkpoint.checkpoint_dir(str(path))
    except CheckpointNotFoundError:
        return False
    except CheckpointError:
        return True
    return True


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """Published steps under `root`, newest first (folders of killed saves are not listed)."""
    return [(step, path) for step, path in _step_folders(root) if _has_checkpoint(path)]


def save_step(root: Path, model, opt, state: dict) -> Path:
    """Collective: save step `state["step"]` through moe.checkpoint; returns its folder."""
    rank, world = _world()
    folder = root / f"{PREFIX}{state['step']:08d}"
    if world == 1:  # noisy routers draw random numbers: resume them too
        state = dict(state, rng=torch.get_rng_state().tolist())
    try:
        moe.checkpoint.save_checkpoint(str(folder), unwrap(model), opt, extra=state)
    except (CheckpointError, OSError) as e:  # a full disk, a quota: the same on every rank
        if rank == 0 and not _has_checkpoint(folder):  # the step's own, now empty, folder
            shutil.rmtree(folder, ignore_errors=True)
        kept = complete_steps(root)
        kept = f"; the newest saved step {kept[0][1]} is intact" if kept else ""
        why = " ".join(str(e).split())
        raise RunError(f"checkpoint step {state['step']} not saved: {why}{kept}") from None
    if rank == 0:  # retention only: the save above is already published
        complete = complete_steps(root)
        for _, old in complete[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
        kept = {path for _, path in complete}
        for _, path in _step_folders(root):
            if path not in kept:  # a killed save's folder, without a checkpoint
                shutil.rmtree(path, ignore_errors=True)
    if world > 1:
        dist.barrier()
    return folder


HISTORY_LISTS = ("step", "loss", "aux", "drop", "lr", "tokens_per_s", "eval_step", "eval_loss")


def check_state(state, step: int) -> None:
    """A ValueError naming the first field of the training state that is missing or of the
    wrong type (the checkpoint is untrusted: checked before anything is loaded)."""

    def bad(field: str, what: str):
        return ValueError(f"training state: field {field!r} {what}")

    if not isinstance(state, dict):
        raise ValueError("training state: not an object")
    if type(state.get("step")) is not int or state["step"] != step:
        raise bad("step", f"must be the directory's step {step}, got {state.get('step')!r}")
    if not isinstance(state.get("config"), dict):
        raise bad("config", "must be an object")
    vocab = state.get("vocab")
    if not isinstance(vocab, list) or not all(isinstance(w, str) for w in vocab):
        raise bad("vocab", "must be a list of words")
    history = state.get("history")
    if not isinstance(history, dict):
        raise bad("history", "must be an object")
    for key in HISTORY_LISTS:
        values = history.get(key)
        if not isinstance(values, list) or not all(_number(v) for v in values):
            raise bad(f"history.{key}", "must be a list of numbers")
    for key in HISTORY_LISTS[1:6]:
        if len(history[key]) != len(history["step"]):
            raise bad(f"history.{key}", f"must have one entry per step ({len(history['step'])})")
    resumed = history.get("resume_step", [])
    if not isinstance(resumed, list) or not all(_number(v) for v in resumed):
        raise bad("history.resume_step", "must be a list of numbers")
    if not isinstance(history.get("title"), str):
        raise bad("history.title", "must be a string")
    if "schedule" in state:
        lr_schedule.check(state["schedule"])
    if "rng" in state:
        rng, size = state["rng"], torch.get_rng_state().numel()
        ok = isinstance(rng, list) and len(rng) == size
        if not ok or not all(type(b) is int and 0 <= b < 256 for b in rng):
            raise bad("rng", f"must be {size} bytes (ints 0..255)")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def load_latest(root: Path, model, opt) -> tuple[dict, Path, list[str]]:
    """(state, step directory, problems with newer steps) of the newest step that loads.

    A step that fails to load (truncated, corrupted, mismatched, a bad training state) is
    reported and skipped; the library's load raises before changing the model, on every rank
    alike.
    """
    problems = []
    for step, path in complete_steps(root):
        try:
            state = moe.checkpoint.load_checkpoint(
                str(path),
                unwrap(model),
                opt,
                check_extra=lambda extra, step=step: check_state(extra, step),
            )
        except (OSError, ValueError, RecursionError) as e:
            problems.append(f"{path.name}: {' '.join(str(e).split())}")  # one line
            continue
        if _world()[1] == 1 and "rng" in state:
            torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
        sync_tied = getattr(model, "sync_tied", None)  # --pp: the head's copy of the embedding
        if sync_tied is not None:
            sync_tied()
        return state, path, problems
    detail = "; ".join(problems) if problems else "no complete step"
    raise FileNotFoundError(f"no loadable checkpoint under {root}: {detail}")


def resume(root: Path, model, opt, cfg: M6Config, data, args, say) -> tuple[dict, int]:
    """Load the newest loadable step under `root`: (history, step); says which step."""
    try:
        state, path, problems = load_latest(root, model, opt)
    except FileNotFoundError as e:
        raise UsageError(f"--resume: {e}") from None
    for problem in problems:
        say(f"warning: skipped checkpoint {problem}")
    differ = config_differences(state["config"], cfg.to_dict())
    if differ:
        raise UsageError(
            f"--resume: {path} was trained with other settings: {differ}; pass the same "
            "settings to continue it, or another --run-dir for a new run"
        )
    if state["vocab"] != data.vocab.words:
        raise UsageError(f"--resume: {path} was trained on another vocabulary (another --data)")
    start = state["step"]
    if start >= args.steps:
        raise UsageError(f"--resume: the checkpoint is at step {start}; pass --steps > {start}")
    args.schedule, which = lr_schedule.on_resume(state.get("schedule"), start, args)
    say(f"resuming from step {start} ({path})")
    say(which)
    history = state["history"]
    history["resume_step"] = [*history.get("resume_step", []), start]  # marked in loss.png
    return history, start


def config_differences(saved: dict, live: dict) -> str:
    """'spare_slots: checkpoint 2, now 4; ...' for each model setting that differs (a setting
    newer than the checkpoint, e.g. fp8, counts as its default there)."""
    defaults = {f.name: f.default for f in fields(M6Config) if f.default is not MISSING}
    saved = {**defaults, **saved}
    keys = sorted(set(saved) | set(live))
    return "; ".join(
        f"{k}: checkpoint {saved.get(k)!r}, now {live.get(k)!r}"
        for k in keys
        if saved.get(k) != live.get(k)
    )


def rank0_then_all(fn, world: int):
    """Run `fn()` on rank 0 only and return its result there (None on the other ranks); if it
    raised a RunFolderError, OSError or ValueError, every rank raises it as one UsageError line."""
    result, problem = None, None
    if _world()[0] == 0:
        try:
            result = fn()
        except (RunFolderError, OSError, ValueError) as e:
            problem = str(e)
    if world > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise UsageError(problem)
    return result


def start_fresh(out: Path, rank: int, world: int, say) -> None:
    """A fresh run never mixes with, or overwrites, an earlier run in the same --run-dir:
    rank 0 moves the whole earlier run into <run-dir>/old-K (nothing is deleted); every
    rank waits for it."""
    moved = rank0_then_all(lambda: set_aside(out), world)
    if moved is not None:
        aside, names = moved
        steps = complete_steps(Path(aside) / "checkpoint")
        newest = f" (newest checkpoint step {steps[0][0]})" if steps else ""
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        say(
            f"note: {out} held an earlier run{newest}: moved it ({shown}) to {aside}; a fresh "
            "run starts at step 0 (--resume continues a run)"
        )
