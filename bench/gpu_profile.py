"""Profiler pieces of the GPU layer benchmark: the kernel table of a few fwd+bwd steps, and the
split of their device time into the GEMM kernels and everything outside them (routing, sort,
gather, scatter, activation, casts): the time a faster GEMM cannot win back."""

import re

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

# Kernel names of the GEMMs: moe's Triton kernels (ragged rows / ragged reduction, the FP8
# block-scaled and weight-gradient GEMMs), CUTLASS and cuBLAS (gemm, xmma, nvjet, cutlass;
# torch._grouped_mm) and the CPU matmuls of a smoke run.
GEMM_KERNEL = re.compile(
    r"ragged_rows|ragged_reduce|block_mm|fp8_wgrad|gemm|xmma|nvjet|cutlass"
    r"|aten::(mm|bmm|_grouped_mm|_scaled_grouped_mm)"
)


def profile_steps(step, steps: int, cuda: bool):
    """torch.profiler over `steps` calls of step(); the kernel events (CUDA) or ops (CPU)."""
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages()


def kernel_table(averages, cuda: bool, rows: int = 15) -> str:
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return averages.table(sort_by=key, row_limit=rows, max_name_column_width=60)


def gemm_split(averages, steps: int, cuda: bool) -> dict:
    """Per step: ms in GEMM kernels, ms outside them, and the kernel count (launches)."""
    gemm_us = other_us = 0.0
    launches = 0
    for ev in averages:
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if cuda and us <= 0:  # host-side events carry no device time
            continue
        if GEMM_KERNEL.search(ev.key):
            gemm_us += us
        else:
            other_us += us
        launches += ev.count
    return {
        "gemm_ms": gemm_us / steps / 1e3,
        "outside_gemm_ms": other_us / steps / 1e3,
        "kernels_per_step": launches / steps,
    }
