"""Saving into a folder the user shares with other files: a lock, and staging directories
that carry a marker so that only what a save wrote itself is ever removed.

One save at a time per folder: `FolderLock` takes an exclusive flock on `<folder>/.moe-save.lock`
without waiting, so a second concurrent saver gets a CheckpointError instead of both reporting
success while one save is lost. The kernel drops the lock when its holder dies, so a killed
save never leaves the folder locked. The holder removes the lock file before releasing it; a
saver that locked a file already removed (it opened it just before) sees that the path no
longer names its file and counts the folder as busy.
"""

import contextlib
import fcntl
import os
import re
import shutil

from moe.checkpoint.errors import CheckpointError

LOCK = ".moe-save.lock"
MARKER = ".moe-staging"  # inside every staging directory a save creates


def new_id() -> str:
    """A fresh 16-hex-digit id from the OS (never from the user's seeded RNGs)."""
    return os.urandom(8).hex()


def lock_file(path: str) -> int | None:
    """A descriptor of `path` (created if needed; a link is not followed) holding an exclusive
    flock, or None when another process holds it (or replaced the file meanwhile). OSError
    when it cannot be created. Closing the descriptor (or the process ending) drops the lock."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        current = os.stat(path, follow_symlinks=False)
        mine = os.fstat(fd)
        if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
            raise BlockingIOError
    except (BlockingIOError, FileNotFoundError):
        os.close(fd)
        return None
    return fd


class FolderLock:
    """Exclusive, non-blocking lock on a save folder (created if needed)."""

    def __init__(self, folder: str):
        self.folder, self.fd = folder, None

    def acquire(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, LOCK)
        try:
            fd = lock_file(path)
        except OSError as e:
            raise CheckpointError(f"cannot create the lock file {path!r}: {e}") from None
        if fd is None:
            raise CheckpointError(
                f"another save into {self.folder!r} is in progress (it holds {path!r}); "
                "nothing was written: save again when it has finished, or into another folder"
            ) from None
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # still holding it: no other saver has it
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def make_staging(folder: str, prefix: str, ident: str) -> str:
    """Create `<folder>/<prefix><ident>/` with the marker that lets a later save remove it
    if this one is killed."""
    staging = os.path.join(folder, f"{prefix}{ident}")
    os.makedirs(staging)
    with open(os.path.join(staging, MARKER), "w"):
        pass
    return staging


def remove_stale_staging(folder: str, prefix: str, keep: str | None = None) -> None:
    """Remove staging directories of killed saves: only `<prefix><16 hex>` directories (not
    links) holding the marker. Call with the folder's lock held."""
    pattern = re.compile(re.escape(prefix) + r"[0-9a-f]{16}")
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name == keep or not pattern.fullmatch(name) or os.path.islink(path):
            continue
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER)):
            shutil.rmtree(path, ignore_errors=True)
