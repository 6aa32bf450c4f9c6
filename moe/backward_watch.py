"""BackwardWatch: which of a layer's training forwards still wait for their backward.

Weights must not move (moe.parallel.rebalance_experts) between a forward and its backward:
autograd would compute the gradients of the old placement. A forward's output passes through
an identity autograd node that marks itself done in backward; the forward is pending while
that node is alive (a weak reference: a graph whose output was dropped dies with it) and its
backward has not run.
"""

import weakref

import torch


class _Mark(torch.autograd.Function):
    """Identity; its backward records that the gradient arrived."""

    @staticmethod
    def forward(ctx, y, done, on_backward):
        ctx.done, ctx.on_backward = done, on_backward
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.done[0] = True
        if ctx.on_backward is not None:
            ctx.on_backward()
        return grad, None, None


class BackwardWatch:
    """The pending training forwards of one layer (host-side bookkeeping, no sync)."""

    def __init__(self) -> None:
        self._watched: list[tuple[weakref.ref, list[bool]]] = []

    def watch(self, y: torch.Tensor, on_backward=None) -> torch.Tensor:
        """`y` (requires grad), watched until its gradient is computed or its graph dies;
        `on_backward()` (optional) runs when the gradient arrives."""
        self._watched = [w for w in self._watched if self._alive(w)]
        done = [False]
        out = _Mark.apply(y, done, on_backward)
        self._watched.append((weakref.ref(out.grad_fn), done))
        return out

    @staticmethod
    def _alive(entry) -> bool:
        ref, done = entry
        return not done[0] and ref() is not None

    def pending(self) -> bool:
        return any(self._alive(w) for w in self._watched)
