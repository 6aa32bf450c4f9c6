"""Bucketed gradient all-reduce, launched during backward, finished before backward returns.

Dense gradients are summed over every rank, expert gradients over the ranks holding the same
experts (the "dp" group); both are divided by the world size, so the gradient equals the
single-process gradient of the mean loss over the global batch whatever the ep size.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    ready: set[int] = field(default_factory=set)
    work: object = None
    flat: torch.Tensor | None = None


class GradientReducer:
    """Buckets of ~bucket_mb are all-reduced asynchronously as soon as their gradients are
    accumulated, strictly in bucket order on every rank (so collectives always match), with
    optional low-precision communication (Whale's half-precision gradient communication)."""

    def __init__(
        self,
        dense: list[nn.Parameter],
        expert: list[nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        world_size: int,
        bucket_mb: float = 25.0,
        comm_dtype: torch.dtype | None = None,
    ):
        self.world_size, self.comm_dtype = world_size, comm_dtype
        self.buckets = self._make_buckets(dense, None, bucket_mb) + self._make_buckets(
            expert, dp_group, bucket_mb
        )
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._next = 0
        self._callback_queued = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for b in self.buckets
            for p in b.params
        ]

    @staticmethod
    def _make_buckets(params, group, bucket_mb):
        limit = bucket_mb * 2**20
        buckets, current, size = [], [], 0
        for p in reversed(params):  # roughly the order backward produces them
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                buckets.append(_Bucket(current, group))
                current, size = [], 0
        if current:
            buckets.append(_Bucket(current, group))
        return buckets

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self.buckets[self._bucket_of[id(param)]]
        bucket.ready.add(id(param))
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = flat.to(self.comm_dtype or flat.dtype).div_(self.world_size)
        bucket.flat = flat
        bucket.work = dist.all_reduce(flat, group=bucket.group, async_op=True)

    def _finish(self) -> None:
        self._launch_ready(force=True)  # parameters without gradients join with zeros
        for bucket in self.buckets:
            bucket.work.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                reduced = bucket.flat[offset : offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = reduced.clone()
                else:
                    p.grad.copy_(reduced)
                offset += n
            bucket.ready.clear()
            bucket.work = bucket.flat = None
        self._next = 0
        self._callback_queued = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
