"""Host side of the sm_90 (TMA) path of the ragged-rows GEMM: when it is used, its alignment
rules, the global scratch that device-built tensor descriptors need, and the persistent grid size.
Holds no @triton.jit code (not reloaded by `common.ensure_mode`)."""

import torch
import triton

from moe.kernels.kernel_config import kernel_config
from moe.kernels.triton.common import interpreting


def tma_default(device: torch.device) -> bool:
    """The TMA path is opt-in (KernelConfig.tma; MOE_TRITON_TMA=1) until it passes the CUDA
    tests and is timed on a GPU (not yet: bench/results/2026-11-28-h200-gpu-summary.md). When
    on, it is used on sm_90+ GPUs and in the interpreter (which runs tensor descriptors)."""
    if not kernel_config().tma:
        return False
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_ok(a_MK, b_EKN, b2_EKN, K: int, split_a: bool, gather: bool) -> bool:
    """TMA needs a unit-stride last dimension and 16-byte aligned strides and bases."""
    es = b_EKN.element_size()
    b_strides = sorted(b_EKN.stride()[1:])
    if b_strides[0] != 1 or b_strides[1] * es % 16 or b_EKN.stride(0) * es % 16:
        return False
    bases = [b_EKN] + ([b2_EKN] if b2_EKN is not None else [])
    if not gather:
        if a_MK.stride(1) != 1 or a_MK.stride(0) * es % 16 or (split_a and K * es % 16):
            return False
        bases.append(a_MK)
    return all(t.data_ptr() % 16 == 0 for t in bases)


def _cuda_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-built tensor descriptors need global scratch (Triton's persistent matmul tutorial).
    Set on every launch: Triton keeps the allocator in a ContextVar, and autograd runs the
    backward on a thread of its own, where a forward's setting is not seen (the first GPU run,
    bench/results/2026-11-28-h200-gpu-check.md: every TMA backward raised "no allocator")."""
    triton.set_allocator(_cuda_scratch)


def persistent_programs(device: torch.device) -> int:
    """Programs of the persistent (TMA) grid: one per SM; 3 in the interpreter, so the tests
    walk the strided tile loop."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count
