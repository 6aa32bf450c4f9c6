"""Metrics of the M6 example: the per-step reduction over ranks (one all-reduce that also
carries the stop request of a signal), the run history, progress output and the summary."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from examples.m6.config import M6Config


class StepMetrics:
    """This rank's sums over the micro-batches of one step, reduced over ranks once."""

    def __init__(self, layers: list):
        self.layers = layers
        self.sums = torch.zeros(4, dtype=torch.float64)  # ce, aux share, dropped, routed pairs

    def add(self, ce: torch.Tensor, aux: torch.Tensor, micro_batches: int) -> None:
        """After a micro-batch's backward: its losses and every MoE layer's routing stats."""
        self.sums[0] += ce.item()
        self.sums[1] += aux.item() / micro_batches
        for _, layer in self.layers:
            s = layer.stats
            self.sums[2] += float(s["dropped"])
            self.sums[3] += float(s["routed_per_expert"].sum())

    def reduce(self, world: int, global_targets: int, stop: bool) -> tuple[dict, bool]:
        """Global metrics of the step, and whether any rank was asked to stop (a signal)."""
        flag = torch.tensor([float(stop)], dtype=torch.float64)
        sums = self.sums
        if world > 1:
            packed = torch.cat([sums, flag])
            dist.all_reduce(packed)
            sums, flag = packed[:4], packed[4:5]
        metrics = {
            "loss": float(sums[0]) / global_targets,
            "aux": float(sums[1]) / world,
            "drop": float(sums[2] / sums[3]) if sums[3] else 0.0,
        }
        return metrics, bool(flag[0] > 0)


class Progress:
    """A tqdm bar on a terminal; piped output (CI, logs) gets one line per finished step."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.enabled, self.total, self.bar = enabled, total, None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
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
