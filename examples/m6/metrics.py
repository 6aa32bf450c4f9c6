"""Metrics of the M6 example: per-step sums kept on the device, read and reduced over ranks
once per log interval (one all-reduce that also carries the stop request of a signal), the
run history and progress output."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from examples.m6.config import M6Config


class StepMetrics:
    """This rank's sums over the micro-batches of one step, kept on the device: adding a
    micro-batch reads nothing back (no host sync); `row()` is the step's metric row."""

    def __init__(self, layers: list, device: torch.device):
        self.layers = layers
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, aux, dropped, routed

    def add(self, ce: torch.Tensor, aux: torch.Tensor, micro_batches: int) -> None:
        """After a micro-batch's backward: its losses and every MoE layer's routing stats."""
        dropped, routed = self.sums.new_zeros(()), self.sums.new_zeros(())
        for _, layer in self.layers:
            s = layer.stats
            dropped = dropped + s["dropped"].detach().to(self.sums)
            routed = routed + s["routed_per_expert"].detach().to(self.sums).sum()
        ce, aux = ce.detach().to(self.sums), aux.detach().to(self.sums) / micro_batches
        self.sums += torch.stack([ce, aux, dropped, routed])

    def row(self, global_targets: torch.Tensor) -> torch.Tensor:
        """[loss share, aux, dropped, routed] on the device; summed over ranks, the loss share
        is the global-batch loss per target token. (Expert load: moe.RoutingTrace.)"""
        sums = self.sums.clone()
        sums[0] /= global_targets.double()  # a CPU scalar: passed by value, no copy or sync
        return sums


class MetricsLog:
    """Metric rows of the steps since the last read, on the device. `flush` reads them (and
    reduces them over ranks) in one transfer: the only host sync of training, once per
    --log-every steps (and before evaluation, a checkpoint or the end)."""

    def __init__(self):
        self.rows: list[torch.Tensor] = []

    def append(self, row: torch.Tensor) -> None:
        self.rows.append(row)

    def flush(self, world: int, stop: bool) -> tuple[list[dict], bool]:
        """(metrics of each pending step, whether any rank was asked to stop). Collective when
        world > 1: every rank flushes at the same steps."""
        rows = torch.stack(self.rows) if self.rows else torch.zeros(0, 4, dtype=torch.float64)
        self.rows = []
        packed = torch.cat([rows.flatten(), rows.new_tensor([float(stop)])])
        if world > 1:
            dist.all_reduce(packed)
        values = packed.cpu().tolist()  # the one read of the window
        width = rows.shape[1]
        steps = [values[i * width : (i + 1) * width] for i in range(rows.shape[0])]
        return [self._metrics(v, world) for v in steps], values[-1] > 0

    def _metrics(self, v: list[float], world: int) -> dict:
        return {"loss": v[0], "aux": v[1] / world, "drop": v[2] / v[3] if v[3] else 0.0}


class Progress:
    """A tqdm bar on a terminal; piped output (CI, logs) gets one line per --log-every read."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.enabled, self.total, self.bar = enabled, total, None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, text: str, steps: int = 1) -> None:
        """`steps` more steps are done, the last being `step` (0-based)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(steps)
        else:
            print(f"step {step + 1}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def new_history(cfg: M6Config) -> dict:
    return {
        "title": cfg.name, "step": [], "loss": [], "aux": [], "drop": [], "lr": [],
        "tokens_per_s": [], "eval_step": [], "eval_loss": [],
    }  # fmt: skip
