"""Shared host-side helpers of the Triton kernels: interpreter mode, dot precision, device checks.

Triton decides at decoration time (`@triton.jit`) whether a kernel is compiled or interpreted
(TRITON_INTERPRET=1). If the kernel modules were imported before the variable was set (or the
other way round), `ensure_mode()` re-imports them so the mode always follows the environment.
This module holds no jitted code, so it is never reloaded itself.
"""

import importlib
import sys

import torch
import triton

from moe import settings
from moe.kernels.kernel_config import kernel_config

# Modules holding @triton.jit code, in dependency order (helpers before the kernels using them).
KERNEL_MODULES = (
    "moe.kernels.triton.lang",
    "moe.kernels.triton.mma",
    "moe.kernels.triton.activations",
    "moe.kernels.triton.schedule",
    "moe.kernels.triton.grouped_mm",
    "moe.kernels.triton.grouped_mm_wgrad",
    "moe.kernels.triton.gather_sum",
    "moe.kernels.triton.row_passes",
)


def autotune_pinned() -> bool:
    """KernelConfig.autotune off (MOE_TRITON_AUTOTUNE=0, which the test suite sets): no
    autotuning, one config per kernel."""
    return not kernel_config().autotune


def autotune_prune(prune=None):
    """The autotuner's early_config_prune, pinned: under MOE_TRITON_AUTOTUNE=0 only the first
    config that `prune` keeps (already fitted to the dtype and epilogue) is returned, so Triton
    compiles that one without benchmarking. Pinning here rather than in the config list keeps
    the pruning: a single listed config would skip it (no fp32 BLOCK_K halving)."""

    def early_config_prune(configs, named_args, **kwargs):
        kept = prune(configs, named_args, **kwargs) if prune is not None else list(configs)
        return kept[:1] if autotune_pinned() else kept

    return early_config_prune


def tile_configs(names: tuple[str, ...], table: list[tuple[int, ...]]) -> list[triton.Config]:
    """A GEMM kernel's autotune configs: under the interpreter one 16-wide tile (fast on CPU),
    else a triton.Config per row of `table`: (the tile sizes in `names`' order, num_warps,
    num_stages)."""
    if interpreting():
        return [triton.Config(dict.fromkeys(names, 16), num_warps=4, num_stages=1)]
    n = len(names)
    return [
        triton.Config(dict(zip(names, row[:n])), num_warps=row[n], num_stages=row[n + 1])
        for row in table
    ]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return settings.triton_interpret()


def ensure_mode() -> None:
    """Re-import the kernel modules if they were built for the other mode (compiled/interpreted)."""
    first = sys.modules.get(KERNEL_MODULES[0])
    if first is None or interpreting() == first.BUILT_INTERPRETED:
        return
    for name in KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


def check_device(*tensors: torch.Tensor | None) -> None:
    """The Triton backend needs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) > 1:
        raise ValueError(
            f"backend='triton' needs every tensor on one device, got {sorted(map(str, devices))}"
        )
    if present and present[0].device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {present[0].device}); on CPU use "
            "backend='torch', or set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter"
        )
    ensure_mode()


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, PRECISION) constexprs for `moe.kernels.triton.mma.mma`.

    DOT_F32: upcast tiles to fp32 before tl.dot. Only under the interpreter, whose bf16 tl.dot is
    wrong (docs/notes.md); compiled kernels keep bf16/fp16 operands on the tensor cores.
    PRECISION: for fp32 operands follow torch's TF32 switch (exact "ieee" by default).
    """
    upcast = interpreting() and dtype == torch.bfloat16
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return upcast, "tf32" if (dtype != torch.float32 or tf32) else "ieee"


def m_bucket(m: int) -> int:
    """Autotune key bucket for the ragged dimension: the next power of two (shapes are host ints)."""
    return triton.next_power_of_2(max(int(m), 1))


def e_pow2(num_experts: int) -> int:
    """Vector width of the in-kernel schedule: E expert segments plus the dropped tail segment."""
    return triton.next_power_of_2(num_experts + 1)


def out_dtype_ok(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"backend='triton' supports float32, float16 and bfloat16, got {dtype}")
