"""The whole expert MLP of all local experts: the one entry point GroupedExperts calls.

Contract (every backend):
  x_TD          token rows; when `token_ids_M` is given, row m of the expert input is
                x_TD[token_ids_M[m]] (gather on load), else x_TD is already the [M, D] buffer.
  offsets_E     int32 cumulative row ends per local expert, on the device; rows at or past
                offsets_E[-1] are dropped pairs and come out exactly zero (no NaN, no garbage).
  w1_EDF, w2_EFD, (w3_EDF for swiglu), optional biases b1_EF, b2_ED.
  returns out_MD in x's dtype. Gradients flow to x and every weight; experts without rows get
  exactly zero weight gradients. No host sync on the Triton path.
"""

import torch

from moe.kernels.activations import GATED, apply_activation, check_activation
from moe.kernels.torch_grouped_mm import grouped_mm_torch

BACKENDS = ("auto", "torch", "triton")


def _row_bias(b_EN: torch.Tensor, offsets_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per-row bias b[expert of row]; tail rows get zero."""
    rows = torch.arange(num_rows, device=offsets_E.device, dtype=offsets_E.dtype)
    expert_M = torch.searchsorted(offsets_E, rows, right=True)
    padded = torch.cat([b_EN, b_EN.new_zeros(1, b_EN.shape[1])])
    return padded[expert_M]


def expert_mlp_torch(
    x_TD,
    offsets_E,
    w1_EDF,
    w2_EFD,
    w3_EDF=None,
    b1_EF=None,
    b2_ED=None,
    activation="gelu",
    token_ids_M=None,
):
    x_MD = x_TD if token_ids_M is None else x_TD.index_select(0, token_ids_M)
    h_MF = grouped_mm_torch(x_MD, w1_EDF, offsets_E)
    if b1_EF is not None:
        h_MF = h_MF + _row_bias(b1_EF, offsets_E, h_MF.shape[0])
    gate_MF = grouped_mm_torch(x_MD, w3_EDF, offsets_E) if activation in GATED else None
    a_MF = apply_activation(h_MF, activation, gate_MF)
    out_MD = grouped_mm_torch(a_MF, w2_EFD, offsets_E)
    if b2_ED is not None:
        out_MD = out_MD + _row_bias(b2_ED, offsets_E, out_MD.shape[0])
    return out_MD


def triton_available(x: torch.Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    try:
        from moe.kernels.triton import expert_mlp  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if triton_available(x) else "torch"
    return backend


def expert_mlp(
    x_TD,
    offsets_E,
    w1_EDF,
    w2_EFD,
    w3_EDF=None,
    b1_EF=None,
    b2_ED=None,
    activation="gelu",
    token_ids_M=None,
    backend="auto",
):
    """Run every local expert's MLP over its rows; see the module docstring for the contract."""
    check_activation(activation)
    if activation in GATED and w3_EDF is None:
        raise ValueError(f"activation={activation!r} needs w3")
    if resolve_backend(backend, x_TD) == "triton":
        from moe.kernels.triton.expert_mlp import expert_mlp_triton

        return expert_mlp_triton(
            x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, activation, token_ids_M
        )
    return expert_mlp_torch(
        x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, activation, token_ids_M
    )
