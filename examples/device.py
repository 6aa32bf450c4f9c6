"""`--device` and `--precision` of the examples: which device this process trains on, and
whether its forward passes run under bf16 autocast.

    auto     CUDA when available (under torchrun: LOCAL_RANK's GPU), else the CPU
    cpu      the CPU
    cuda     LOCAL_RANK's GPU (0 in a single process)
    cuda:N   GPU N

An unknown or unavailable device is a ValueError with one line saying why, raised before any
work starts (the examples turn it into their `error:` line). Checked against torch 2.11+.
"""

from __future__ import annotations

import argparse
import os
import re
from contextlib import nullcontext

import torch

DEVICE_HELP = "auto (CUDA when available), cpu, cuda (LOCAL_RANK's GPU) or cuda:N"
PRECISION_HELP = "auto: bf16 autocast on CUDA, fp32 on the CPU; fp32 turns autocast off"


def add_device_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add --device and --precision to an example's parser."""
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument(
        "--precision", choices=("auto", "fp32", "bf16"), default="auto", help=PRECISION_HELP
    )


def local_rank() -> int:
    """torchrun's LOCAL_RANK (0 outside torchrun)."""
    text = os.environ.get("LOCAL_RANK", "0")
    if not text.isdigit():
        raise ValueError(f"LOCAL_RANK={text!r} is not a GPU index")
    return int(text)


def resolve_device(spec: str) -> torch.device:
    """The torch.device named by `spec` (see the module docstring), checked to exist."""
    text = spec.strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    if text == "auto":
        return _cuda(local_rank(), spec) if torch.cuda.is_available() else torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise ValueError(f"--device {spec!r} is unknown: use {DEVICE_HELP}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine (use cpu)")
    index = local_rank() if match.group(1) is None else int(match.group(1))
    return _cuda(index, spec)


def _cuda(index: int, spec: str) -> torch.device:
    count = torch.cuda.device_count()
    if index >= count:
        source = "" if ":" in spec else f" (LOCAL_RANK={index})"
        raise ValueError(
            f"--device {spec}: no GPU {index}{source}; this machine has {count} GPU(s)"
        )
    return torch.device("cuda", index)


def use_bf16(precision: str, device: torch.device) -> bool:
    """Whether forward passes run under bf16 autocast ("auto": on CUDA only)."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast(precision: str, device: torch.device):
    """The autocast context of the forward passes (a no-op context in fp32)."""
    if use_bf16(precision, device):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def backend(device: torch.device) -> str:
    """The process-group backend for this device: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def activate(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (NCCL and kernels follow it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
