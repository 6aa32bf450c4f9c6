"""Which original forward a recompute repeats: a context_fn for torch.utils.checkpoint.

    checkpoint(block, x, use_reentrant=False, context_fn=moe.recompute_context)

Each checkpointed call gets one RecomputeFrame, entered around its forward and around every
recompute of it in backward. A value that a forward takes once (router replay's record index)
is noted on the frame in the original forward and handed back, in the same order, to each
recompute: whatever order backward runs the regions in, however many forwards ran before the
backward, and whether or not some forward's output was dropped. MoEConfig.recompute and
moe.memory.recompute_blocks pass it; pass it to your own checkpointing too (Hugging Face:
`model.gradient_checkpointing_enable({"use_reentrant": False, "context_fn":
moe.recompute_context})`). The frame stack is per thread (a CUDA backward recomputes on
autograd's device thread, inside that thread's recompute context).
"""

import threading
from collections.abc import Callable, Hashable

_local = threading.local()


def _stack() -> list["RecomputeFrame"]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class RecomputeFrame:
    """The values each key took in one checkpointed call's original forward, in order."""

    def __init__(self):
        self.notes: dict[Hashable, list] = {}
        self.read: dict[Hashable, int] = {}  # values handed back in the running recompute
        self.recomputing = False

    def _enter(self, recomputing: bool) -> None:
        if recomputing:
            self._refuse_stale_keys()
        self.recomputing, self.read = recomputing, {}
        _stack().append(self)

    def _refuse_stale_keys(self) -> None:
        """Before a recompute: a key whose `stale_reason()` says it can no longer hand its
        values back (a replay block left since the forward) stops the backward with that
        reason, before the recompute computes anything different from its forward."""
        for key in self.notes:
            reason = getattr(key, "stale_reason", None)
            message = reason() if callable(reason) else None
            if message:
                raise RuntimeError(message)

    def _exit(self) -> None:
        _stack().remove(self)
        self.recomputing = False

    def take(self, key: Hashable):
        """The next value `key` took in the original forward (recompute only)."""
        i = self.read.get(key, 0)
        values = self.notes.get(key, [])
        if i >= len(values):
            raise RuntimeError(
                f"recompute asks {key} for value {i + 1}; its original forward took {len(values)}"
            )
        self.read[key] = i + 1
        return values[i]


class _Entered:
    """A frame entered for its forward or for a recompute (re-enterable: backward with
    retain_graph=True recomputes again)."""

    def __init__(self, frame: RecomputeFrame, recomputing: bool):
        self.frame, self.recomputing = frame, recomputing

    def __enter__(self) -> None:
        self.frame._enter(self.recomputing)

    def __exit__(self, *exc) -> None:
        self.frame._exit()


def recompute_context() -> tuple[_Entered, _Entered]:
    """torch.utils.checkpoint's context_fn: (forward context, recompute context) of one frame."""
    frame = RecomputeFrame()
    return _Entered(frame, False), _Entered(frame, True)


def in_frame_recompute() -> bool:
    """True inside the recompute of a call checkpointed with recompute_context."""
    return any(f.recomputing for f in _stack())


def once_per_forward(key: Hashable, new: Callable[[], object]):
    """`new()` in an original forward; in a recompute, the value the original forward got.
    The value is noted on every checkpointed call this forward runs inside (nested calls too),
    so that their recomputes get it back."""
    stack = _stack()
    source = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].recomputing), None)
    value = new() if source is None else stack[source].take(key)
    for frame in stack[0 if source is None else source + 1 :]:
        frame.notes.setdefault(key, []).append(value)
    return value


__all__ = ["RecomputeFrame", "in_frame_recompute", "once_per_forward", "recompute_context"]
