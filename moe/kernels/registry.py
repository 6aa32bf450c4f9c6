"""The expert-kernel registry: each kernel is one registered object that declares what it takes.

A kernel (torch, triton, triton with CUDA's CUTLASS grouped GEMM for its GEMM roles, a feature
package's own ...) is an `ExpertKernel`: its name, the device types, dtypes and weight formats
it takes, whether it applies the combine itself (`fuses_combine`), its own settings as dataclass fields,
and two entry points: `mlp` (the expert MLP of every local expert, the contract of
moe/kernels/expert_mlp.py) and `combine` (the weighted gather-sum of each token's k rows).
A new kernel is one file: a subclass and `register_kernel(MyKernel("name"))`; MoEConfig's
`backend="name"` then selects it (moe.names.BACKENDS reads the registry).

A feature's settings choose a kernel through the one hook every registry entry has,
`claims(config)` (kernel_for_layer). A `KernelWrapper` (a feature that changes the expert MLP
of whichever kernel runs, register_kernel_wrapper) claims a layer the same way; the one
generic step: claimed wrappers apply after the base kernel is chosen (resolve_kernel). A
wrapper that composes the MLP from the base kernel's grouped GEMMs needs them declared
(`GroupedGemms`); a kernel without them is refused under it, never bypassed.

The layer resolves its kernel once (moe.experts.GroupedExperts.kernel_for) and hands the
object down; nothing on the path carries a name.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moe.kernels.activations import GATED, check_activation
from moe.kernels.combine import combine_torch
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows
from moe.kernels.expert_weights import DENSE, ExpertWeights
from moe.kernels.torch_grouped_mm import grouped_mm_torch
from moe.names import BACKENDS, KERNEL_WRAPPERS, KERNELS, claimed, register

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ExpertKernel(ABC):
    """One way to compute the experts. devices / dtypes: the device types and weight dtypes it
    takes (None: any); formats: ExpertWeights.format values it reads; fuses_combine: it can
    gather on load, scale by the combine weights and sum rows into tokens (the ExpertRows
    contract), so a dispatcher may hand it the combine; takes_row_weights: it may get the
    combine weights on its rows (False: its numerics must see the rows unweighted, as they
    arrive between ranks, e.g. GEMMs in a number format whose scales are per row).

    selected_by: the setting that chooses this kernel when a feature's settings do (e.g.
    "MoEConfig.<feature>"): `claims` returns the kernel for a layer those settings ask it for,
    and MoEConfig(backend=name) alone is refused (one setting chooses it)."""

    name: str
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = FLOATS
    formats: tuple[str, ...] = (DENSE,)
    fuses_combine: bool = True
    takes_row_weights: bool = True
    selected_by = None  # class attribute: None, or the setting that chooses it (see above)

    def claims(self, config) -> "ExpertKernel | None":
        """The kernel, with the layer's settings, that a layer with MoEConfig `config` must run
        on because its settings ask for it; None: the settings do not (the default)."""
        return None

    def refuse(self, x: torch.Tensor, weights: ExpertWeights) -> str | None:
        """Why this kernel cannot take input x with these weights, or None: checked by the
        layer before any work (MoELayer names itself and the kernel in the error)."""
        if self.devices is not None and x.device.type not in self.devices:
            return f"it runs on {'/'.join(self.devices)} tensors, the input is on {x.device}"
        if self.dtypes is not None and weights.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"it takes {names} weights, these are {weights.dtype}"
        if weights.format not in self.formats:
            return f"it reads weight formats {self.formats}, these are {weights.format!r}"
        return None

    def __call__(
        self,
        x_ND: torch.Tensor,
        offsets_L: torch.Tensor,
        weights: ExpertWeights,
        *,
        activation: str = "gelu",
        rows: ExpertRows = NO_ROWS_INFO,
    ) -> torch.Tensor:
        """The expert MLP (contract: moe/kernels/expert_mlp.py), its arguments checked."""
        check_activation(activation)
        if activation in GATED and weights.w3_LDF is None:
            raise ValueError(f"activation={activation!r} needs w3")
        return self.mlp(x_ND, offsets_L, weights, activation=activation, rows=rows)

    @abstractmethod
    def mlp(
        self,
        x_ND: torch.Tensor,
        offsets_L: torch.Tensor,
        weights: ExpertWeights,
        *,
        activation: str,
        rows: ExpertRows,
    ) -> torch.Tensor:
        """Every local expert's MLP over its rows (moe/kernels/expert_mlp.py's contract)."""

    def combine(
        self, out_MD: torch.Tensor, pair_rows_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> torch.Tensor:
        """y_TD[t] = sum_j weights_TK[t, j] * out_MD[pair_rows_TK[t, j]] (the dispatchers'
        combine when the experts return rows); the torch op unless a kernel has its own."""
        return combine_torch(out_MD, pair_rows_TK, weights_TK)

    def auto_on(self, device: torch.device) -> bool:
        """Whether backend="auto" picks this kernel on `device` (see resolve_kernel)."""
        return False


class GroupedGemms:
    """A capability a kernel declares (a mixin of its ExpertKernel class): its differentiable
    ragged grouped GEMMs (rows of group e times w[e], tail rows zero), so a kernel wrapper can
    compose an expert MLP of its own from them. `weight_mm`: the GEMM on the experts' weights
    as this kernel computes them (e.g. in a narrower number format); `plain_mm`: in the
    operands' dtype, for tensors of the wrapper's own. The torch op unless a kernel has its own."""

    def weight_mm(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor):
        return grouped_mm_torch(x_MK, w_EKN, offsets_E)

    def plain_mm(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor):
        return grouped_mm_torch(x_MK, w_EKN, offsets_E)

    def project(self, x_MK: torch.Tensor, name: str, weights, offsets_E: torch.Tensor):
        """x @ the experts' projection `name` ("w1", "w2" or "w3" of `weights`): weight_mm,
        unless a wrapper that changes each projection (and declares GroupedGemms itself)
        overrides it, so a wrapper composing its own MLP around it keeps that change."""
        w = {"w1": weights.w1_LDF, "w2": weights.w2_LFD, "w3": weights.w3_LDF}[name]
        return self.weight_mm(x_MK, w, offsets_E)


@dataclass(frozen=True)
class KernelWrapper:
    """A feature's change to the expert MLP of whichever kernel a layer resolved: `claims`
    returns the wrapper for a layer whose settings (`selected_by`) ask for it, `wrap` the
    kernel that runs (an ExpertKernel around the base; its `refuse` says when the base cannot
    serve, e.g. it lacks a capability the wrapper needs)."""

    name: str
    selected_by = None  # class attribute: the setting that chooses it

    def claims(self, config) -> "KernelWrapper | None":
        return None

    def wrap(self, kernel: ExpertKernel) -> ExpertKernel:
        raise NotImplementedError


def register_kernel_wrapper(wrapper: KernelWrapper) -> KernelWrapper:
    """Make `wrapper` claimable by a layer's settings (kernel_wrappers_for); returns it."""
    if not isinstance(wrapper, KernelWrapper):
        raise TypeError(f"register_kernel_wrapper takes a KernelWrapper, got {type(wrapper)}")
    return register(KERNEL_WRAPPERS, wrapper, "kernel wrapper")


def kernel_wrappers_for(config) -> tuple[KernelWrapper, ...]:
    """The wrappers a layer with MoEConfig `config` applies around its kernel, in registration
    order (each registered wrapper's `claims`)."""
    return tuple(claimed(KERNEL_WRAPPERS, config))


AUTO_ORDER = ("triton", "torch")  # backend="auto": the first whose auto_on(device) holds


def register_kernel(kernel: ExpertKernel) -> ExpertKernel:
    """Make `kernel` selectable as MoEConfig(backend=kernel.name); returns it."""
    if not isinstance(kernel, ExpertKernel):
        raise TypeError(f"register_kernel takes an ExpertKernel, got {type(kernel).__name__}")
    if kernel.name == "auto":
        raise ValueError('"auto" is not a kernel name: it picks one (resolve_kernel)')
    return register(KERNELS, kernel, "kernel")


def get_kernel(name: str) -> ExpertKernel:
    if name not in KERNELS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS}")
    return KERNELS[name]


def kernel_for_layer(config) -> "str | ExpertKernel":
    """What a layer's GroupedExperts resolve (their `backend`): the kernel the layer's settings
    claim (ExpertKernel.claims), which config.backend must leave to "auto" or name itself; else
    config.backend. One setting chooses a claimed kernel: naming it without its settings is a
    ValueError."""
    kernels = claimed(KERNELS, config)
    if len(kernels) > 1:
        raise ValueError(f"kernels {[k.name for k in kernels]} each claim this layer's experts")
    if kernels:
        kernel = kernels[0]
        if config.backend not in ("auto", kernel.name):
            raise ValueError(
                f"{kernel.selected_by} runs the experts on kernel {kernel.name!r}, but "
                f"backend={config.backend!r} asks for another one: use backend='auto'"
            )
        return kernel
    named = KERNELS.get(config.backend)
    if named is not None and named.selected_by is not None:
        raise ValueError(
            f"backend={config.backend!r} is chosen by {named.selected_by}, not by name"
        )
    return config.backend


def resolve_kernel(
    name: "str | ExpertKernel", device: torch.device, wrappers: tuple[KernelWrapper, ...] = ()
) -> ExpertKernel:
    """The kernel a layer with backend=`name` runs on `device`, then each of `wrappers` around
    it (kernel_wrappers_for: claimed wrappers apply after the base kernel is chosen). The base:
    "auto" -> the first of AUTO_ORDER that is registered and auto_on(device) ("triton" on CUDA
    with Triton installed, else "torch"); a name -> its kernel; a kernel object -> itself."""
    kernel = _base_kernel(name, device)
    for wrapper in wrappers:
        kernel = wrapper.wrap(kernel)
    return kernel


def _base_kernel(name: "str | ExpertKernel", device: torch.device) -> ExpertKernel:
    if isinstance(name, ExpertKernel):
        return name
    if name != "auto":
        return get_kernel(name)
    for candidate in AUTO_ORDER:
        kernel = KERNELS.get(candidate)
        if kernel is not None and kernel.auto_on(device):
            return kernel
    return get_kernel("torch")
