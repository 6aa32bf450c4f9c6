"""GroupedApply: any torch.optim optimizer applied in size-balanced groups, one after another
(Whale's group-wise apply), with fp32 master weights, fp16 loss scaling and CPU offload.

Why groups: a foreach optimizer step allocates temporaries as large as the parameters it
updates (AdamW: the denominator sqrt(v) + eps; with master weights also the fp32 copies of
the gradients). Stepping G groups one after another keeps only one group's temporaries
alive, so the step's extra peak memory falls as ~1/G. With offload, only one group's
gradients and weights are in flight between device and host at a time.

Each group has its own inner optimizer over "shadow" tensors: the parameters themselves
(fp32, no offload), device fp32 masters (low-precision parameters), or host copies
(offload). Per-parameter math is the inner optimizer's, so results equal the plain optimizer.
Construction, lookup and the step live here; state in and out in grouped_state.py, the
offloaded step's host pipeline in offload.py.
"""

from collections.abc import Iterable

import torch
from torch import nn

from moe.memory.grouped_state import GroupedState, StateView, hyper
from moe.memory.offload import Entry, HostPipeline, adopt_edits, host_empty
from moe.memory.precision import LOW_PRECISION, LossScaler
from moe.shards import local, local_all

OFFLOAD_MODES = (None, "optimizer", "all")


def partition_balanced(sizes: list[int], groups: int) -> list[list[int]]:
    """Split indices into `groups` lists of near-equal total size (largest first into the
    lightest group); each list keeps the original order. A group is at least as large as
    the largest single tensor in it: tensors are not split."""
    if groups <= 0:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    totals = [0] * groups
    members: list[list[int]] = [[] for _ in range(groups)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(groups), key=lambda g: (totals[g], g))
        totals[g] += sizes[i]
        members[g].append(i)
    return [sorted(m) for m in members if m]


class GroupedApply(GroupedState, torch.optim.Optimizer):
    """`GroupedApply(params, torch.optim.AdamW, groups=4, offload=None, **optim_kwargs)`.

    params: parameters or (name, parameter) pairs. offload: None; "optimizer" (optimizer
    state in host memory, weights stay authoritative on the device; each step fetches them);
    "all" (optimizer state and the fp32 master weights on the host: the device holds only the
    low-precision parameters). master_weights: keep fp32 masters for bf16/fp16 parameters
    (default: when any parameter is low precision). loss_scaler: dynamic loss scaling,
    created automatically when any parameter is fp16; use `opt.scale_loss(loss).backward()`.

    Behaves like a torch optimizer: step(), zero_grad(), state_dict()/load_state_dict(),
    param_groups (one per apply group; LR schedulers work), state[param].
    """

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        groups: int = 4,
        offload: str | None = None,
        *,
        master_weights: bool | None = None,
        loss_scaler: LossScaler | None = None,
        **optim_kwargs,
    ):
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"offload={offload!r} is not one of {OFFLOAD_MODES}")
        if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        names, tensors = _split_named(params)
        dtypes = {p.dtype for p in tensors}
        if master_weights is None:
            master_weights = bool(dtypes & set(LOW_PRECISION))
        if loss_scaler is None and torch.float16 in dtypes:
            loss_scaler = LossScaler()
        self.optimizer_class, self.offload = optimizer_class, offload
        self.master_weights, self.loss_scaler = master_weights, loss_scaler
        self.num_groups = groups
        self._entries = [self._make_entry(i, n, p) for i, (n, p) in enumerate(zip(names, tensors))]
        self._by_id = {id(e.param): e for e in self._entries}
        # Balance what this rank holds: a DTensor's local shard (parallelize), else the tensor.
        parts = partition_balanced([t.numel() for t in local_all(tensors)], groups)
        self._groups = [[self._entries[i] for i in part] for part in parts]
        kwargs = self._inner_kwargs(optimizer_class, optim_kwargs)
        self._inner = [self._make_inner([e.shadow for e in g], kwargs) for g in self._groups]
        self._group_of = {id(e): g for g, es in enumerate(self._groups) for e in es}
        self._initializing = True
        hypers = [hyper(inner.param_groups[0]) for inner in self._inner]
        super().__init__(
            [{"params": [e.param for e in g], **h} for g, h in zip(self._groups, hypers)],
            dict(self._inner[0].defaults),
        )
        self._initializing = False
        self.state = StateView(self)
        self._pipeline = None
        if offload is not None:
            self._pipeline = HostPipeline(self._groups, tensors[0].device, offload)
        self._grad_factor: float | torch.Tensor | None = None
        self._found_inf = False
        self._unscaled = False
        self._state_pinned = False

    # -- construction ------------------------------------------------------------------
    def _make_entry(self, index: int, name: str | None, param: nn.Parameter) -> Entry:
        low = param.dtype in LOW_PRECISION and self.master_weights
        shadow_dtype = torch.float32 if low else param.dtype
        with torch.no_grad():
            if self.offload is None:
                shadow = param.detach().to(torch.float32, copy=True) if low else param
                return Entry(index, name, param, shadow, shadow if low else None)
            # A DTensor parameter (parallelize, ddp or fsdp): the host keeps this rank's shard.
            pin, shard = param.device.type == "cuda", local(param.detach())
            shadow = host_empty(shard.shape, shadow_dtype, pin).copy_(shard)
            if self.offload == "all":
                return Entry(index, name, param, shadow, shadow if low else None)
            master = param.detach().to(torch.float32, copy=True) if low else None
            return Entry(index, name, param, shadow, master)

    def _inner_kwargs(self, cls, kwargs: dict) -> dict:
        """Offloaded steps run on the CPU: vectorised (fused, else foreach) unless told."""
        kwargs = dict(kwargs)
        if self.offload is not None and "fused" not in kwargs and "foreach" not in kwargs:
            code = cls.__init__.__code__
            accepted = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            if "fused" in accepted:
                kwargs["fused"] = True
            elif "foreach" in accepted:
                kwargs["foreach"] = True
        return kwargs

    def _make_inner(self, shadows: list[torch.Tensor], kwargs: dict) -> torch.optim.Optimizer:
        try:
            return self.optimizer_class(shadows, **kwargs)
        except (RuntimeError, ValueError):
            if kwargs.get("fused") and self.offload is not None:  # fused unsupported here
                kwargs = {**{k: v for k, v in kwargs.items() if k != "fused"}, "foreach": True}
                return self.optimizer_class(shadows, **kwargs)
            raise

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_initializing", True):
            raise NotImplementedError("GroupedApply builds its groups at construction")
        super().add_param_group(param_group)

    # -- lookup --------------------------------------------------------------------------
    def _entry_of(self, param: torch.Tensor) -> Entry:
        entry = self._by_id.get(id(param))
        if entry is None or entry.param is not param:
            raise KeyError("parameter is not managed by this GroupedApply")
        return entry

    def _inner_of(self, entry: Entry) -> torch.optim.Optimizer:
        return self._inner[self._group_of[id(entry)]]

    @property
    def params(self) -> list[nn.Parameter]:
        return [e.param for e in self._entries]

    @property
    def param_names(self) -> list[str | None]:
        return [e.name for e in self._entries]

    def index_of(self, param: torch.Tensor) -> int:
        return self._entry_of(param).index

    # -- mixed precision -----------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * scale with an fp16 loss scaler, else loss unchanged."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    def unscale_(self) -> None:
        """Check the (scaled) gradients for inf/NaN on every rank and record 1/scale as a
        factor applied to each group's fp32 gradients during step: low-precision gradients
        are never divided in place, so small ones do not flush to zero. Idempotent per step.
        """
        if self.loss_scaler is None or self._unscaled:
            return
        grads = [e.param.grad for e in self._entries if e.param.grad is not None]
        self._found_inf = self.loss_scaler.found_inf(grads)
        self.mul_grads_(1.0 / self.loss_scaler.scale)
        self._unscaled = True

    def mul_grads_(self, factor: float | torch.Tensor) -> None:
        """Scale every gradient by `factor` lazily, inside the next step (clip, unscale)."""
        self._grad_factor = factor if self._grad_factor is None else self._grad_factor * factor

    @property
    def pending_grad_factor(self) -> float | torch.Tensor | None:
        return self._grad_factor

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.loss_scaler is not None:
            self.unscale_()
            self.loss_scaler.update(self._found_inf)
            skip = self._found_inf
        else:
            skip = False
        factor = self._grad_factor
        self._grad_factor, self._unscaled, self._found_inf = None, False, False
        if skip:
            return loss
        for group, inner in zip(self.param_groups, self._inner):
            inner.param_groups[0].update(hyper(group))
        if self._pipeline is not None:
            if isinstance(factor, torch.Tensor):  # the CPU step needs it on the host
                factor = float(factor)
            self._pipeline.run(lambda g: self._inner[g].step(), factor)
            self._pin_host_state()
        else:
            for g in range(len(self._groups)):
                self._step_on_device(g, factor)
        return loss

    def _step_on_device(self, g: int, factor) -> None:
        entries = [e for e in self._groups[g] if e.param.grad is not None]
        if not entries:
            return
        direct = [e.param.grad for e in entries if e.shadow is e.param]
        mastered = [e for e in entries if e.shadow is not e.param]
        if direct and factor is not None:
            torch._foreach_mul_(local_all(direct), factor)
        if mastered:  # this group's fp32 gradient copies: the only ones alive at a time
            adopt_edits(
                local_all([e.shadow for e in mastered]), local_all([e.param for e in mastered])
            )
            grads = [torch.empty_like(e.shadow) for e in mastered]
            torch._foreach_copy_(local_all(grads), local_all([e.param.grad for e in mastered]))
            if factor is not None:
                torch._foreach_mul_(local_all(grads), factor)
            for e, grad in zip(mastered, grads):
                e.shadow.grad = grad
        self._inner[g].step()
        if mastered:
            for e in mastered:
                e.shadow.grad = None
            params, shadows = [e.param for e in mastered], [e.shadow for e in mastered]
            torch._foreach_copy_(local_all(params), local_all(shadows))

    def _pin_host_state(self) -> None:
        """Move lazily created host optimizer state into pinned memory once (CUDA only)."""
        if self._state_pinned or not torch.cuda.is_available():
            return
        if not any(e.param.device.type == "cuda" for e in self._entries):
            return
        for inner in self._inner:
            for state in inner.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() > 0:
                        state[k] = v.pin_memory()
        self._state_pinned = True


def _split_named(params: Iterable) -> tuple[list[str | None], list[nn.Parameter]]:
    items = list(params)
    if not items:
        raise ValueError("GroupedApply got an empty parameter list")
    if any(isinstance(x, dict) for x in items):
        raise TypeError("GroupedApply takes a flat list of parameters; it builds its own groups")
    if all(isinstance(x, tuple) and len(x) == 2 for x in items):
        names, tensors = [n for n, _ in items], [p for _, p in items]
    elif any(isinstance(x, tuple) for x in items):
        raise TypeError("params must be all tensors or all (name, tensor) pairs")
    else:
        names, tensors = [None] * len(items), items
    seen = set()
    for p in tensors:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"GroupedApply params must be tensors, got {type(p).__name__}")
        if id(p) in seen:
            raise ValueError("a parameter appears twice in GroupedApply's params")
        seen.add(id(p))
    devices = {p.device for p in tensors}
    if len(devices) > 1:
        raise ValueError(f"GroupedApply needs all parameters on one device, got {devices}")
    return names, tensors
