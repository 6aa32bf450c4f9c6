"""The side watcher of a pipeline step: a thread that reads the ranks' failure reports while
the calling thread runs the schedule, and ends the calling thread's part of a step that failed
elsewhere.

One daemon thread per Pipeline, idle between steps (it waits on an event, no polling). During
a step it calls `read()` every POLL_S, then less often up to every POLL_MAX_S (one small store
request per rank). When `read()` returns reports (or raises: the store is gone), it keeps them
in `reports`, calls `on_failure()` (the pipeline aborts its NCCL communicators there, which
ends a blocked wait) and raises StepInterrupted in the calling thread (CPython's
PyThreadState_SetAsyncExc): a thread running Python code stops at its next bytecode; a thread
blocked inside one C call (a gloo wait, which no API ends) stops when that call returns, at the
latest at the wait's own timeout. At most one StepInterrupted per step; `end()` cancels one not
yet delivered, so none leaks past the step.
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from collections.abc import Callable

# how often the watcher reads the reports: every POLL_S at first, doubling up to POLL_MAX_S
POLL_S, POLL_MAX_S = 0.05, 1.0


class StepInterrupted(BaseException):
    """Raised in the calling thread by the watcher: another rank reported a failure. A
    BaseException, so no `except Exception` on the way (torch's or the model's) swallows it."""


class Watcher:
    """Watches one step at a time: begin() on the calling thread starts it, end() stops it.
    The thread holds the Watcher weakly and reaches `read` and `on_failure` through it."""

    def __init__(self, read: Callable[[], list], on_failure: Callable[[], None], name: str):
        self.reports: list | None = None
        self.error: BaseException | None = None  # read() raised (the store was lost)
        self.read, self.on_failure = read, on_failure
        self._lock = threading.Lock()
        self._active = threading.Event()  # set while a step is watched
        stopped = threading.Event()  # set when the Watcher is collected, or at exit
        self._target: int | None = None  # the calling thread's id while a step runs
        self._sent = False
        thread = threading.Thread(
            target=_loop,
            args=(weakref.ref(self), self._active, stopped),
            daemon=True,
        )
        thread.name = name
        thread.start()
        # the thread ends with the Watcher, or at interpreter exit before the process groups
        # are torn down (a thread still reading the store then aborted the process)
        weakref.finalize(self, _stop, stopped, self._active)

    def begin(self) -> None:
        with self._lock:
            self.reports, self.error, self._sent = None, None, False
            self._target = threading.get_ident()
            self._active.set()

    def end(self) -> None:
        """Stops watching; a StepInterrupted sent but not yet raised is withdrawn. Idempotent."""
        with self._lock:
            self._active.clear()
            if self._sent and self._target is not None:
                _async_raise(self._target, None)
            self._target = None

    def _fire(self, reports: list | None, error: BaseException | None) -> bool:
        """On the watcher thread: records the failure and interrupts the calling thread, once
        per step. False when no step is watched any more."""
        with self._lock:
            if self._target is None or self._sent:
                return False
            self.reports, self.error, self._sent = reports, error, True
            self._active.clear()
            _async_raise(self._target, StepInterrupted)
            return True


def _stop(stopped: threading.Event, active: threading.Event) -> None:
    stopped.set()
    active.set()  # wakes the loop, which returns


def _loop(ref, active: threading.Event, stopped: threading.Event) -> None:
    """The watcher thread; it holds its Watcher weakly and ends when `stopped` is set."""
    while True:
        active.wait()
        if stopped.is_set():
            return
        poll = POLL_S
        while active.is_set() and not stopped.is_set():
            watcher = ref()
            if watcher is None:
                return
            reports, error = None, None
            try:
                reports = watcher.read() or None
            except Exception as e:  # noqa: BLE001 - the store's host may be gone
                error = e
            if (reports is not None or error is not None) and watcher._fire(reports, error):
                watcher.on_failure()
            del watcher
            if reports is not None or error is not None:
                break
            time.sleep(poll)
            poll = min(2 * poll, POLL_MAX_S)


def _async_raise(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `thread_id` at its next bytecode (None withdraws a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )
