"""Dynamic loss scaling for fp16 training (bf16 needs none: it has fp32's exponent range)."""

import torch
import torch.distributed as dist

LOW_PRECISION = (torch.float16, torch.bfloat16)


class LossScaler:
    """Multiply the loss by `scale` so small fp16 gradients do not flush to zero; skip the
    optimizer step when any gradient on any rank is inf/NaN and halve the scale; double it
    after `growth_interval` clean steps.

    `found_inf` is a host decision (whether to step at all), so it syncs once per step: one
    `.item()` after a single all-reduce of a flag, never one per tensor.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-14,
    ):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                "LossScaler needs init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1"
            )
        if growth_interval <= 0:
            raise ValueError(f"growth_interval must be > 0, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def found_inf(self, grads: list[torch.Tensor], group=None) -> bool:
        """Whether any gradient here or on any rank of `group` (default: the world) is
        inf/NaN. One all-reduce of a flag and one host sync."""
        flags = []
        for device_grads in _by_device_and_dtype(grads).values():
            flag = torch.zeros(1, device=device_grads[0].device)
            one = torch.ones(1, device=flag.device)
            torch._amp_foreach_non_finite_check_and_unscale_(device_grads, flag, one)
            flags.append(flag)
        flag = torch.stack([f.to(flags[0].device) for f in flags]).amax() if flags else None
        flag = torch.zeros(()) if flag is None else flag
        if dist.is_available() and dist.is_initialized():
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            flag = flag.to(device).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped", 0))


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    out: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out
