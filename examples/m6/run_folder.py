"""The run directory of an M6 run: one run at a time, and a fresh run never overwrites another.

- `RunLock`: rank 0 holds an exclusive flock on `<run-dir>/.m6-run.lock` for the run's whole
  life (the kernel drops it when the process dies, so a killed run never leaves the folder
  locked). A second run into the same folder, fresh or `--resume`, is one clear error before
  it touches anything, instead of moving the first run's live checkpoint/ from under it.
- `set_aside`: a fresh run (no `--resume`) into a folder that holds an earlier run moves ALL
  of that run (checkpoint/, summary.json, routing_trace.jsonl, the plots, anything else in
  the folder) into `<run-dir>/old-K/` (K the least unused; nothing is deleted or overwritten,
  links are moved as links, dangling or not). Earlier `old-K` folders stay where they are.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from moe.checkpoint.folder import lock_file

LOCK = ".m6-run.lock"
OLD = re.compile(r"old-\d+")
# what an M6 run writes into its folder: a folder holding none of these is not a run's
RUN_FILES = ("checkpoint", "summary.json", "routing_trace.jsonl", "loss.png",
             "expert_load.png", "samples.png")  # fmt: skip


class RunFolderError(RuntimeError):
    """The run directory is in use by another run, or holds something that is not a run."""


class RunLock:
    """Exclusive, non-blocking lock on a run directory for the life of the run."""

    def __init__(self, folder: Path):
        self.folder, self.fd = Path(folder), None

    def acquire(self) -> None:
        path = self.folder / LOCK
        try:
            fd = lock_file(str(path))
        except OSError as e:
            raise RunFolderError(f"--run-dir {self.folder}: cannot create {path}: {e}") from None
        if fd is None:
            holder = "unknown"
            with contextlib.suppress(OSError):  # the holder's pid, as it wrote it
                holder = path.read_bytes()[:64].decode(errors="replace").strip() or holder
            raise RunFolderError(
                f"--run-dir {self.folder} is in use by another run (process {holder}): wait "
                "for it to finish, or pass another --run-dir"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the flock; the file stays (removing it would race)
            self.fd = None


def earlier_run(folder: Path) -> list[str]:
    """Names of the entries of an earlier run in `folder` (all but the lock and old-K)."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(
            e.name for e in folder.iterdir() if e.name != LOCK and not OLD.fullmatch(e.name)
        )
    return []


def set_aside(folder: Path) -> tuple[Path, list[str]] | None:
    """Move the earlier run in `folder` into `folder/old-K`; returns (that path, the names
    moved), or None when there was nothing to move. Call with the folder's RunLock held."""
    names = earlier_run(folder)
    if not names:
        return None
    if not any(n in RUN_FILES or n.startswith("checkpoint.old-") for n in names):
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise RunFolderError(
            f"--run-dir {folder} holds files that are not an M6 run's ({shown}): pass a new or "
            "empty folder (a fresh run sets an earlier run aside, never other files)"
        )
    k = 1
    while os.path.lexists(folder / f"old-{k}"):
        k += 1
    aside = folder / f"old-{k}"
    aside.mkdir()
    for name in names:
        os.rename(folder / name, aside / name)  # a link moves as a link (dangling or not)
    return aside, names
