"""`--device`, `--precision` and `--threads` of the examples: which device this process trains
on, whether its forward passes run under bf16 autocast, and how many CPU threads it computes
with.

    auto     CUDA when available (under torchrun: LOCAL_RANK's GPU), else the CPU
    cpu      the CPU
    cuda     LOCAL_RANK's GPU (0 in a single process)
    cuda:N   GPU N

An unknown or unavailable device is a ValueError with one line saying why, raised before any
work starts (the examples turn it into their `error:` line). Checked against torch 2.11+.

--threads: CPU intra-op threads per process. The default is 1: the examples' tiny models have
matrices too small for more threads to pay, and on a shared or busy machine threads only wait
for each other (examples/hf/finetune.py on 2 loaded cores: 6 min with torch's default of one
thread per core, 27 s with one). 0 keeps torch's default; more than this process's cores
shared by the node's ranks (LOCAL_WORLD_SIZE) is refused: that oversubscribes.
"""

from __future__ import annotations

import argparse
import os
import re
from contextlib import nullcontext

import torch

DEVICE_HELP = "auto (CUDA when available), cpu, cuda (LOCAL_RANK's GPU) or cuda:N"
PRECISION_HELP = "auto: bf16 autocast on CUDA, fp32 on the CPU; fp32 turns autocast off"


THREADS_HELP = (
    "CPU threads per process (default 1: the tiny models' matrices are too small for more "
    "threads to pay, they only contend; 0: torch's default)"
)


def add_device_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add --device, --precision and --threads to an example's parser."""
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument(
        "--precision", choices=("auto", "fp32", "bf16"), default="auto", help=PRECISION_HELP
    )
    parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP)


def cores_per_rank() -> int:
    """This process's usable cores shared by the node's ranks (torchrun's LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max((cores or 1) // (int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1), 1)


def threads_problem(threads: int) -> str | None:
    """Why --threads cannot be used (one line), or None."""
    if not 0 <= threads <= cores_per_rank():
        return (
            f"--threads must be between 0 (torch's default) and {cores_per_rank()} (this "
            f"process's share of the cores), got {threads}"
        )
    return None


def set_threads(threads: int, device: torch.device) -> None:
    """Compute with `threads` CPU threads (0: torch's default) when training on the CPU."""
    if device.type == "cpu" and threads > 0:
        torch.set_num_threads(threads)


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
