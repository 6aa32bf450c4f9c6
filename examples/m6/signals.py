"""Stopping an M6 run on SIGTERM / SIGINT: the loop finishes its step, saves
and exits with 128 + the signal's number."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path


class Interrupted(RuntimeError):
    """SIGTERM/SIGINT: the step in progress was finished and saved; exit status 128 + signal."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        saved = (
            f"checkpoint {checkpoint} (continue with --resume)"
            if checkpoint is not None
            else "not saved"
        )
        super().__init__(f"interrupted by {name} after step {step}; {saved}")


class StopOnSignal:
    """While active, SIGTERM and SIGINT only set `signum`; the loop finishes its step, saves
    and stops. A second signal (Ctrl-C twice) exits at once with one line, saving nothing
    (the previous checkpoint stays: saves are atomic)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        name = signal.Signals(signum).name
        sys.stderr.write(f"error: {name} again: exiting now without saving this step\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
