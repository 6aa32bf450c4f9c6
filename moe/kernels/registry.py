"""The expert-kernel registry: each kernel is one registered object that declares what it takes.

A kernel (torch, triton, triton with CUDA's CUTLASS grouped GEMM for its GEMM roles, later
FP8 ...) is an `ExpertKernel`: its name, the device types, dtypes and weight formats it takes,
whether it applies the combine itself (`fuses_combine`), its own settings as dataclass fields,
and two entry points: `mlp` (the expert MLP of every local expert, the contract of
moe/kernels/expert_mlp.py) and `combine` (the weighted gather-sum of each token's k rows).
A new kernel is one file: a subclass and `register_kernel(MyKernel("name"))`; MoEConfig's
`backend="name"` then selects it (moe.names.BACKENDS reads the registry).

The layer resolves its kernel once (moe.experts.GroupedExperts.kernel_for) and hands the
object down; nothing on the path carries a name.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moe.kernels.activations import GATED, check_activation
from moe.kernels.adapted_mlp import adapted_mlp
from moe.kernels.combine import combine_torch
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows
from moe.kernels.expert_weights import DENSE, ExpertWeights
from moe.kernels.torch_grouped_mm import grouped_mm_torch
from moe.names import BACKENDS, KERNELS, register

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ExpertKernel(ABC):
    """One way to compute the experts. devices / dtypes: the device types and weight dtypes it
    takes (None: any); formats: ExpertWeights.format values it reads; fuses_combine: it can
    gather on load, scale by the combine weights and sum rows into tokens (the ExpertRows
    contract), so a dispatcher may hand it the combine; takes_row_weights: it may get the
    combine weights on its rows (False: its numerics must see the rows unweighted, as they
    arrive between ranks, e.g. FP8 GEMMs whose scales are per row).

    selected_by: the setting that chooses this kernel when a feature's settings do (e.g.
    "MoEConfig.fp8"): `for_layer` returns the kernel for a layer those settings ask it for,
    and MoEConfig(backend=name) alone is refused (one setting chooses it)."""

    name: str
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = FLOATS
    formats: tuple[str, ...] = (DENSE,)
    fuses_combine: bool = True
    takes_row_weights: bool = True
    selected_by = None  # class attribute: None, or the setting that chooses it (see above)

    def for_layer(self, config) -> "ExpertKernel | None":
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
        if weights.adapters:  # low-rank adapters (moe.lora): one composed path for every kernel
            return adapted_mlp(self, x_ND, offsets_L, weights, activation=activation, rows=rows)
        return self.mlp(x_ND, offsets_L, weights, activation=activation, rows=rows)

    def grouped_mm(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor):
        """This kernel's differentiable ragged grouped GEMM on the experts' weights (rows of
        group e times w[e], tail rows zero): the base GEMMs of the adapted MLP
        (moe/kernels/adapted_mlp.py). The torch op unless a kernel has its own (FP8: e4m3)."""
        return grouped_mm_torch(x_MK, w_EKN, offsets_E)

    def adapter_mm(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor):
        """The plain grouped GEMM (the operands' dtype) the adapters' GEMMs run on."""
        return grouped_mm_torch(x_MK, w_EKN, offsets_E)

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
    claim (ExpertKernel.for_layer, e.g. FP8 experts), which config.backend must leave to "auto"
    or name itself; else config.backend. One setting chooses a claimed kernel: naming it
    without its settings is a ValueError."""
    claimed = [k for k in (k.for_layer(config) for k in list(KERNELS.values())) if k is not None]
    if len(claimed) > 1:
        raise ValueError(f"kernels {[k.name for k in claimed]} each claim this layer's experts")
    if claimed:
        kernel = claimed[0]
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


def resolve_kernel(name: "str | ExpertKernel", device: torch.device) -> ExpertKernel:
    """The kernel a layer with backend=`name` runs on `device`: "auto" -> the first of
    AUTO_ORDER that is registered and auto_on(device) ("triton" on CUDA with Triton
    installed, else "torch"); a name -> its kernel; a kernel object -> itself."""
    if isinstance(name, ExpertKernel):
        return name
    if name != "auto":
        return get_kernel(name)
    for candidate in AUTO_ORDER:
        kernel = KERNELS.get(candidate)
        if kernel is not None and kernel.auto_on(device):
            return kernel
    return get_kernel("torch")
