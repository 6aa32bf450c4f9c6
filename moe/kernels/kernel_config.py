"""KernelConfig: the settings of the Triton kernels, the one process-wide config of them.

Triton's autotuner decides per kernel, not per layer, so the kernel settings are one config for
the process (`set_kernel_config`), with the environment variables of moe/settings.py as
overrides of its fields, read each time a kernel asks.
"""

from dataclasses import dataclass, fields, replace

from moe import settings


@dataclass(frozen=True)
class KernelConfig:
    """autotune: autotune the Triton kernels (False: the first config their pruning keeps, no
        benchmarking; the test suite's choice). Override: MOE_TRITON_AUTOTUNE=0.
    tma: the sm_90 tensor-memory-accelerator path of the ragged GEMM (opt-in until it has run
        on a GPU). Override: MOE_TRITON_TMA=1."""

    autotune: bool = True
    tma: bool = False

    def __post_init__(self):
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise ValueError(
                    f"KernelConfig.{f.name} must be a bool, got {getattr(self, f.name)!r}"
                )


_config = KernelConfig()


def set_kernel_config(config: KernelConfig | None) -> None:
    """Use `config` for every Triton kernel from now on; None returns to the defaults."""
    global _config
    if config is not None and not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig or None, got {type(config).__name__}")
    _config = config or KernelConfig()


def kernel_config() -> KernelConfig:
    """The kernel settings now: the set config, its fields overridden by the environment."""
    changes = {}
    for f in fields(KernelConfig):
        value = settings.flag_override(f"KernelConfig.{f.name}")
        if value is not None:
            changes[f.name] = value
    return replace(_config, **changes) if changes else _config
