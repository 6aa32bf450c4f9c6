"""The CPU-offload step of GroupedApply: device gradients -> host, step on the CPU, host
weights -> device, group by group through double-buffered pinned staging.

Timeline on CUDA (two side streams, so copies overlap the CPU's work):
    d2h stream:  [grads g0] [grads g1]            [grads g2] ...
    CPU:                    [step g0]  [step g1]  [step g2] ...
    h2d stream:                       [w g0]     [w g1]    ...
Group g+1's gradients are copied while group g steps; group g's weights are uploaded while
group g+1 steps. Staging buffers alternate between two slots, and a slot is rewritten only
after the copy that last used it has completed (its event). On a CPU-only machine host and
device are the same memory: the same code runs with plain synchronous copies.
"""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from moe.shards import local, local_all


@dataclass
class Entry:
    """One parameter as GroupedApply sees it.

    shadow: the tensor the inner optimizer updates (the parameter itself, a device fp32
    master, or a host copy). master: the authoritative fp32 master weights, if any.
    """

    index: int
    name: str | None
    param: torch.nn.Parameter
    shadow: torch.Tensor
    master: torch.Tensor | None = None


def adopt_edits(masters: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """Each fp32 master takes the elements of its low-precision parameter that changed since
    the master was last rounded into it (an edit through `.data`: an init, an EMA, a load);
    the other elements keep the master's precision. One compare-and-select pass per step: an
    edit is invisible to autograd's version counter, so it is found by value."""
    for m, p in zip(masters, params):
        edited = p != m.to(p.dtype)  # NaN compares unequal: a NaN parameter is taken too
        m.copy_(torch.where(edited, p.to(m.dtype), m))


def host_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


class _Staging:
    """Two slots of flat host buffers, one per dtype, each as large as the largest group's
    share of that dtype; `views` hands out per-tensor views in order."""

    def __init__(self, sizes_by_dtype: dict[torch.dtype, int], pin: bool):
        self.slots = [
            {dt: host_empty((n,), dt, pin) for dt, n in sizes_by_dtype.items() if n}
            for _ in range(2)
        ]

    def views(self, slot: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        offsets: dict[torch.dtype, int] = {}
        out = []
        for t in like:
            start = offsets.get(t.dtype, 0)
            offsets[t.dtype] = start + t.numel()
            out.append(self.slots[slot][t.dtype][start : start + t.numel()].view(t.shape))
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for slot in self.slots for b in slot.values())


def _group_sizes(groups: list[list[Entry]], pick: Callable[[Entry], torch.dtype | None]):
    """dtype -> the largest per-group element count of entries that `pick` maps to it."""
    sizes: dict[torch.dtype, int] = {}
    for entries in groups:
        per: dict[torch.dtype, int] = {}
        for e in entries:
            dt = pick(e)
            if dt is not None:
                per[dt] = per.get(dt, 0) + local(e.param).numel()
        for dt, n in per.items():
            sizes[dt] = max(sizes.get(dt, 0), n)
    return sizes


class HostPipeline:
    """Runs `step_group(g)` for every group with host-resident shadows.

    mode "all": a host fp32 master (low-precision parameter) is authoritative; only gradients
    go down and updated weights go up (cast to the parameter dtype on the host first, so the
    upload moves 2 bytes per bf16 parameter). Everywhere else the device weights (param or
    device fp32 master) are authoritative and are fetched with the gradients: an fp32
    parameter's host copy is a cache, and a change made on the device by any means (in place
    through `.data`, `p.data = t`, a load or a rebalance) is invisible to autograd's version
    counter, so the copy is refreshed every step rather than trusted (the copy runs on the
    d2h stream, overlapped with the previous group's CPU step).
    """

    def __init__(self, groups: list[list[Entry]], device: torch.device, mode: str):
        self.groups, self.mode = groups, mode
        self.cuda = device.type == "cuda"
        self.device = device
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.grads = _Staging(_group_sizes(groups, lambda e: e.param.dtype), self.cuda)
        needs_cast = lambda e: (  # noqa: E731
            e.param.dtype if mode == "all" and e.shadow.dtype != e.param.dtype else None
        )
        self.casts = _Staging(_group_sizes(groups, needs_cast), self.cuda)
        self._d2h_done: list = [None] * len(groups)
        self._h2d_done: list = [None, None]
        self._fetched: list[list[Entry]] = [[] for _ in groups]
        self._sent: list[list[torch.Tensor]] = [[] for _ in groups]  # parameters fetched

    @property
    def staging_bytes(self) -> int:
        return self.grads.nbytes + self.casts.nbytes

    def _stream(self, stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _record(self, stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def run(self, step_group: Callable[[int], None], factor: float | None) -> None:
        if self.cuda:  # gradients come from, and weights go back to, the compute stream's work
            current = torch.cuda.current_stream(self.device)
            self.d2h.wait_stream(current)
            self.h2d.wait_stream(current)
        order = [g for g, entries in enumerate(self.groups) if entries]
        if order:
            self._fetch(order[0], 0)
        for i, g in enumerate(order):
            if i + 1 < len(order):
                self._fetch(order[i + 1], (i + 1) % 2)
            if self._d2h_done[g] is not None:
                self._d2h_done[g].synchronize()
            self._attach(g, i % 2, factor)
            step_group(g)
            self._writeback(g, i % 2)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)
            for event in self._h2d_done:  # the next step rewrites these host buffers
                if event is not None:
                    event.synchronize()

    def _fetch(self, g: int, slot: int) -> None:
        entries = [e for e in self.groups[g] if e.param.grad is not None]
        self._fetched[g] = entries
        if not entries:
            return
        with self._stream(self.d2h):
            grads = local_all([e.param.grad for e in entries])
            torch._foreach_copy_(self.grads.views(slot, grads), grads, non_blocking=self.cuda)
            # the device weights, where they are authoritative (every shadow but a host master),
            # after a device master takes its parameter's edits
            copies = [e for e in entries if not self._host_master(e)]
            mastered = [e for e in copies if e.master is not None]
            adopt_edits(
                local_all([e.master for e in mastered]), local_all([e.param for e in mastered])
            )
            hosted = [e for e in entries if self._host_master(e)]
            if hosted:  # the parameters, to find their edits against the host masters
                if self._h2d_done[slot] is not None and self.cuda:  # the upload reading it
                    self.d2h.wait_event(self._h2d_done[slot])
                params = local_all([e.param for e in hosted])
                views = self.casts.views(slot, params)
                torch._foreach_copy_(views, params, non_blocking=self.cuda)
                self._sent[g] = views
            if copies:
                sources = local_all([e.param if e.master is None else e.master for e in copies])
                shadows = [e.shadow for e in copies]
                torch._foreach_copy_(shadows, sources, non_blocking=self.cuda)
        self._d2h_done[g] = self._record(self.d2h)

    def _attach(self, g: int, slot: int, factor: float | None) -> None:
        entries = self._fetched[g]
        hosted = [e for e in entries if self._host_master(e)]
        adopt_edits([e.master for e in hosted], self._sent[g])  # the parameters' edits
        staged = self.grads.views(slot, local_all([e.param.grad for e in entries]))
        convert = [i for i, e in enumerate(entries) if e.shadow.dtype != staged[i].dtype]
        if convert:
            converted = [torch.empty_like(entries[i].shadow) for i in convert]
            torch._foreach_copy_(converted, [staged[i] for i in convert])
            for i, t in zip(convert, converted):
                staged[i] = t
        if factor is not None and staged:
            torch._foreach_mul_(staged, factor)
        for e, grad in zip(entries, staged):
            e.shadow.grad = grad

    def _writeback(self, g: int, slot: int) -> None:
        entries = self._fetched[g]
        for e in entries:
            e.shadow.grad = None
        if not entries:
            return
        shadows = [e.shadow for e in entries]
        if self.mode == "optimizer":
            targets = local_all([e.master if e.master is not None else e.param for e in entries])
            sources = shadows
        else:
            targets = local_all([e.param for e in entries])
            cast = [i for i, e in enumerate(entries) if e.shadow.dtype != e.param.dtype]
            sources = list(shadows)
            if cast:
                if self._h2d_done[slot] is not None:  # the upload that last read this slot
                    self._h2d_done[slot].synchronize()
                buffers = self.casts.views(slot, local_all([entries[i].param for i in cast]))
                torch._foreach_copy_(buffers, [shadows[i] for i in cast])  # cast on the host
                for i, b in zip(cast, buffers):
                    sources[i] = b
        with self._stream(self.h2d):
            torch._foreach_copy_(targets, sources, non_blocking=self.cuda)
            mastered = [e for e in entries if self.mode == "optimizer" and e.master is not None]
            if mastered:  # device fp32 master -> low-precision parameter, on the device
                params = local_all([e.param for e in mastered])
                torch._foreach_copy_(params, local_all([e.master for e in mastered]))
        self._h2d_done[slot] = self._record(self.h2d)

    def _host_master(self, e: Entry) -> bool:
        """`e`'s shadow is its fp32 master kept on the host ("all" with a low-precision
        parameter): the authoritative weights, never fetched."""
        return self.mode == "all" and e.master is not None
