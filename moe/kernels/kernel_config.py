"""KernelConfig: the settings of the Triton kernels, the one process-wide config of them.

Triton's autotuner decides per kernel, not per layer, so the kernel settings are one config for
the process (`set_kernel_config`), with the environment variables of moe/settings.py as
overrides of its fields, read each time a kernel asks.
"""

from dataclasses import dataclass, replace

from moe import settings
from moe.kernels import gemm_roles

_FLAGS = ("autotune", "tma")  # KernelConfig's bool fields; each has an environment override


@dataclass(frozen=True)
class KernelConfig:
    """autotune: autotune the Triton kernels (False: the first config their pruning keeps, no
        benchmarking; the test suite's choice). Override: MOE_TRITON_AUTOTUNE=0.
    tma: the sm_90 tensor-memory-accelerator path of the ragged GEMM (opt-in until it has run
        on a GPU). Override: MOE_TRITON_TMA=1.
    cutlass_roles: the GEMM roles of the Triton expert MLP run on CUTLASS (torch._grouped_mm)
        instead of the Triton kernels, e.g. ("up", "dx"); None: the table of
        moe/kernels/gemm_roles.py (measured per shape class); (): every role on Triton."""

    autotune: bool = True
    tma: bool = False
    cutlass_roles: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        roles = self.cutlass_roles
        if roles is not None and not (
            isinstance(roles, tuple) and all(r in gemm_roles.ROLES for r in roles)
        ):
            raise ValueError(
                f"KernelConfig.cutlass_roles must be None or a tuple of GEMM roles "
                f"({', '.join(gemm_roles.ROLES)}), got {roles!r}"
            )

    def roles_on_cutlass(self, d_model: int, d_ff: int) -> tuple[str, ...]:
        """The expert MLP's GEMM roles run on CUTLASS at this expert geometry: cutlass_roles
        when set, else the measured table's (moe/kernels/gemm_roles.py)."""
        if self.cutlass_roles is not None:
            return self.cutlass_roles
        return gemm_roles.cutlass_roles(d_model, d_ff)


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
    for name in _FLAGS:
        value = settings.flag_override(f"KernelConfig.{name}")
        if value is not None:
            changes[name] = value
    return replace(_config, **changes) if changes else _config
