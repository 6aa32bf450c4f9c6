"""The settings that change a run's math, in one line (issue 49 item 15): printed once by the
examples and benchmarks and named in their plots' titles, so what ran is visible.

    settings: fp32, FP8 off, dp 1 x ep 2 (2 ranks), ddp, offload none, 1 optimizer group,
    no replicas
"""

from __future__ import annotations

import torch

from examples.device import use_bf16


def precision_text(precision: str, device: torch.device) -> str:
    """'bf16 autocast (fp32 masters)' or 'fp32', as examples/device.py's autocast applies."""
    return "bf16 autocast (fp32 masters)" if use_bf16(precision, device) else "fp32"


def fp8_text(fp8) -> str:
    """Which parts run in FP8 and their scale formats (a moe.fp8.FP8Config, or None)."""
    if fp8 is None or not (fp8.dispatch or fp8.experts):
        return "FP8 off"
    parts = []
    if fp8.dispatch:
        parts.append(f"dispatch e4m3 (1x{fp8.block_size} blocks, {fp8.scale_format} scales)")
    if fp8.experts:
        parts.append(f"expert GEMMs e4m3 ({fp8.recipe}, {fp8.gemm_scale_format} scales)")
    return "FP8 " + " + ".join(parts)


def settings_line(
    *,
    precision: str,
    device: torch.device,
    fp8=None,
    dp: int = 1,
    ep: int = 1,
    data_parallel: str | None = "ddp",
    offload: str = "none",
    groups: int = 1,
    replicas: int = 0,
    extra: tuple[str, ...] = (),
) -> str:
    """The one line (without 'settings: ') of what changes the math of a run."""
    world = dp * ep
    parts = [
        precision_text(precision, device),
        fp8_text(fp8),
        f"dp {dp} x ep {ep} ({world} rank{'s' if world > 1 else ''})",
    ]
    if data_parallel:
        parts.append(data_parallel)
    parts += [
        f"offload {offload}",
        f"{groups} optimizer group{'s' if groups > 1 else ''}",
        f"{replicas} spare expert slots (replicas)" if replicas else "no replicas",
        *extra,
    ]
    return ", ".join(parts)
