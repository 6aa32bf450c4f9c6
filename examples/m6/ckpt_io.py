"""Checkpoint steps of an M6 run: each step is one atomic unit.

    <run-dir>/checkpoint/step-00000120/weights/   model + optimizer (moe.checkpoint.save_checkpoint)
    <run-dir>/checkpoint/step-00000120/state.json step, history, config, vocabulary (+ RNG)

Everything of step N is written into `.step-N.partial` and published by one rename, so a kill
at any moment leaves either the complete step or nothing of it; resume takes the newest step
that loads, falling back to older ones. Older steps are pruned only after a newer one is
published (the newest `KEEP` stay).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import moe.parallel
from examples.m6.setup import unwrap
from moe.checkpoint.api import fsync_dir

KEEP = 2
PREFIX, PARTIAL = "step-", ".partial"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """Published steps under `root`, newest first (partial ones are not listed)."""
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        number = path.name.removeprefix(PREFIX)
        if path.name.startswith(PREFIX) and number.isdigit() and path.is_dir():
            steps.append((int(number), path))
    return sorted(steps, reverse=True)


def save_step(root: Path, model, opt, state: dict) -> Path:
    """Collective: write step `state["step"]` and publish it atomically; returns its directory."""
    rank, world = _world()
    step = state["step"]
    final = root / f"{PREFIX}{step:08d}"
    staging = root / f".{PREFIX}{step:08d}{PARTIAL}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed save of the same step
        staging.mkdir()
    if world > 1:
        dist.barrier()
    moe.checkpoint.save_checkpoint(str(staging / "weights"), unwrap(model), opt, extra={"step": step})
    if world == 1:  # noisy routers draw random numbers: resume them too
        state = dict(state, rng=torch.get_rng_state().tolist())
    if rank == 0:
        with open(staging / "state.json", "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(staging)
        if final.exists():  # the same step saved again (e.g. a signal right after --save-every)
            shutil.rmtree(final)
        os.rename(staging, final)
        fsync_dir(root)
        for _, old in complete_steps(root)[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
        for path in root.glob(f".{PREFIX}*{PARTIAL}"):
            shutil.rmtree(path, ignore_errors=True)
    if world > 1:
        dist.barrier()
    return final


HISTORY_LISTS = ("step", "loss", "aux", "drop", "lr", "tokens_per_s", "eval_step", "eval_loss")


def check_state(state, step: int) -> None:
    """A ValueError naming the first field of state.json that is missing or of the wrong type
    (the file is untrusted: checked before anything is loaded)."""

    def bad(field: str, what: str):
        return ValueError(f"state.json: field {field!r} {what}")

    if not isinstance(state, dict):
        raise ValueError("state.json does not hold an object")
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
    if not isinstance(history.get("title"), str):
        raise bad("history.title", "must be a string")
    if "rng" in state:
        rng, size = state["rng"], torch.get_rng_state().numel()
        ok = isinstance(rng, list) and len(rng) == size
        if not ok or not all(type(b) is int and 0 <= b < 256 for b in rng):
            raise bad("rng", f"must be {size} bytes (ints 0..255)")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def load_latest(root: Path, model, opt) -> tuple[dict, Path, list[str]]:
    """(state, step directory, problems with newer steps) of the newest step that loads.

    A step that fails to load (truncated, corrupted, mismatched) is reported and skipped;
    the library's load raises before changing the model, on every rank alike.
    """
    problems = []
    for step, path in complete_steps(root):
        try:
            state = json.loads((path / "state.json").read_text())
            check_state(state, step)
            extra = moe.checkpoint.load_checkpoint(str(path / "weights"), unwrap(model), opt)
            if extra.get("step") != step:
                raise ValueError(f"weights of step {extra.get('step')}, directory of {step}")
        except (OSError, ValueError, RecursionError) as e:
            problems.append(f"{path.name}: {e}")
            continue
        if _world()[1] == 1 and "rng" in state:
            torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
        return state, path, problems
    detail = "; ".join(problems) if problems else "no complete step"
    raise FileNotFoundError(f"no loadable checkpoint under {root}: {detail}")
