"""Multi-rank test harness (gloo on CPU, forked ranks) that reports failures instead of hanging.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each of which:
  * takes the parent's current environment and working directory, sets torchrun's variables
    (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE = world_size, MASTER_ADDR/MASTER_PORT),
    GLOO_SOCKET_IFNAME=lo, then ``env`` on top (a value of None unsets a variable), and uses
    one intra-op thread (the test machines have 2 cores);
  * calls ``dist.init_process_group("gloo", ...)`` on a free localhost port with a collective
    timeout of ``timeout`` seconds, so a collective missing a peer fails instead of waiting;
  * runs ``fn(rank, world_size, *args)`` and sends back its (picklable) result, or the
    formatted traceback of whatever it raised.
The parent collects the results and returns them as a list indexed by rank. If any rank fails
(raises, dies without reporting, or misses the overall ``deadline``), the others get ``grace``
seconds to finish, every straggler is killed, and an AssertionError lists each failing rank's
traceback ("rank N timed out", "rank N was killed after rank M failed", ...).

Ranks are forked from a multiprocessing "forkserver": one process per test session that only
imported torch, torch.distributed and moe (``PRELOAD``; it runs no torch op and starts no
process group), instead of a fresh interpreter importing them again for every rank of every
call (several seconds of CPU each on the 2-core CI machine). A forked rank imports only what
``fn``'s module adds.

``fn`` and ``args`` must be picklable: define ``fn`` at module level in an importable module
(tests/ is a package, so ``tests.test_x._body`` works under pytest). Batch many checks into one
call: starting the ranks and their process group still costs a second or so.

Example::

    def _body(rank, world_size, n):
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t.tolist()

    def test_sum():
        assert run_ranks(_body, 4, 3, timeout=30)[0] == [6.0] * 3
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Imported once by the forkserver before it forks any rank (a module missing here is imported
# by the rank itself, as before).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "moe",
    "pytest",  # every test module imports it
    "safetensors",
    "tests.distributed",
]


def _context() -> mp.context.BaseContext:
    """The forkserver context, its server importing PRELOAD before its first fork."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    env: dict[str, str | None],
    args: tuple,
    results: mp.Queue,
    parent_env: dict[str, str],
    cwd: str,
) -> None:
    """Body of one rank: init gloo, run fn, report ("ok", pickled) or ("error", text)."""
    os.chdir(cwd)
    os.environ.clear()  # the parent's environment now, not the forkserver's at its start
    os.environ.update(parent_env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GLOO_SOCKET_IFNAME": "lo",
        }
    )
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        outcome = ("ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        outcome = ("error", traceback.format_exc())
    results.put((rank, *outcome))
    results.close()
    results.join_thread()
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # the result is already reported
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str | None] | None = None,
    deadline: float | None = None,
    grace: float = 5.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; results by rank.

    timeout: collective timeout of the process group (seconds). deadline: overall wall-clock
    limit for the whole run, default max(2 * timeout, timeout + 60) (startup included).
    grace: seconds the other ranks get to finish after the first failure before being killed.
    Raises AssertionError describing every rank that failed, died or timed out.
    """
    deadline = max(2 * timeout, timeout + 60.0) if deadline is None else deadline
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                rank,
                world_size,
                port,
                timeout,
                dict(env or {}),
                args,
                results,
                dict(os.environ),
                os.getcwd(),
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    ok: dict[int, bytes] = {}
    failed: dict[int, str] = {}
    dead_since: dict[int, float] = {}
    first_failure: tuple[int, float] | None = None
    end = time.monotonic() + deadline
    try:
        while len(ok) + len(failed) < world_size:
            now = time.monotonic()
            limit = end if first_failure is None else min(end, first_failure[1] + grace)
            if now >= limit:
                break
            try:
                rank, status, payload = results.get(timeout=min(0.2, limit - now))
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r in ok or r in failed or p.exitcode is None:
                        continue
                    # Give a message already in the pipe a moment before calling the rank dead.
                    if now - dead_since.setdefault(r, now) > 2.0:
                        failed[r] = f"rank {r} exited with code {p.exitcode} without a result"
                        first_failure = first_failure or (r, time.monotonic())
                continue
            if status == "ok":
                ok[rank] = payload
            else:
                failed[rank] = payload
                first_failure = first_failure or (rank, time.monotonic())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
    if failed or len(ok) < world_size:
        lines = []
        for r in range(world_size):
            if r in failed:
                lines.append(f"--- rank {r} failed:\n{failed[r].rstrip()}")
            elif r not in ok:
                why = (
                    f"was killed after rank {first_failure[0]} failed"
                    if first_failure is not None
                    else f"timed out (no result within {deadline:.0f} s)"
                )
                lines.append(f"--- rank {r} {why}")
        raise AssertionError(f"{fn.__name__} on {world_size} ranks:\n" + "\n".join(lines))
    return [pickle.loads(ok[r]) for r in range(world_size)]
