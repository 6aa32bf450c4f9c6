"""KernelConfig: the settings of the Triton kernels, the one process-wide config of them.

Triton's autotuner decides per kernel, not per layer, so the kernel settings are one config for
the process (`set_kernel_config`). A field left unset (None) takes its environment variable
(moe/settings.py), else its default, when the config is built: the process's config is built
once, when a kernel first asks (or a KernelConfig is passed to `set_kernel_config`), so a
variable changed later changes nothing until `set_kernel_config(None)` builds it again.
"""

from dataclasses import dataclass

from moe import settings
from moe.kernels import gemm_roles

_DEFAULTS = {"autotune": True, "tma": False}  # the bool fields; each has an environment override
_FLAGS = tuple(_DEFAULTS)


@dataclass(frozen=True)
class KernelConfig:
    """autotune: autotune the Triton kernels (False: the first config their pruning keeps, no
        benchmarking; the test suite's choice). Unset: MOE_TRITON_AUTOTUNE, else True.
    tma: the sm_90 tensor-memory-accelerator path of the ragged GEMM (opt-in until it has run
        on a GPU). Unset: MOE_TRITON_TMA, else False.
    cutlass_roles: the GEMM roles of the Triton expert MLP run on CUTLASS (torch._grouped_mm)
        instead of the Triton kernels, e.g. ("up", "dx"); None: the table of
        moe/kernels/gemm_roles.py (measured per shape class); (): every role on Triton."""

    autotune: bool | None = None
    tma: bool | None = None
    cutlass_roles: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in _FLAGS:
            value = getattr(self, name)
            if value is None:  # not given in code: the environment, else the default
                value = settings.read(f"KernelConfig.{name}")
                object.__setattr__(self, name, _DEFAULTS[name] if value is None else value)
            elif not isinstance(value, bool):
                raise ValueError(f"KernelConfig.{name} must be a bool, got {value!r}")
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


_config: KernelConfig | None = None  # built when a kernel first asks


def set_kernel_config(config: KernelConfig | None) -> None:
    """Use `config` for every Triton kernel from now on; None: a KernelConfig() built from the
    environment when a kernel next asks."""
    global _config
    if config is not None and not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig or None, got {type(config).__name__}")
    _config = config


def kernel_config() -> KernelConfig:
    """The process's kernel settings (the environment was read once, when they were built)."""
    global _config
    if _config is None:
        _config = KernelConfig()
    return _config
