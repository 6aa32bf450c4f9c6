"""The whole expert MLP of all local experts: the one entry point GroupedExperts calls.

Contract (every backend):
  x_TD          token rows; when `token_ids_M` is given, row m of the expert input is
                x_TD[token_ids_M[m]] (gather on load), else x_TD is already the [M, D] buffer.
  offsets_E     int32 cumulative row ends per local expert, on the device; rows at or past
                offsets_E[-1] are dropped pairs and come out exactly zero (no NaN, no garbage).
  w1_EDF, w2_EFD, (w3_EDF for swiglu), optional biases b1_EF, b2_ED.
  row_weights_M optional per-row scale (the combine weights folded into the experts): out row m
                is then row_weights_M[m] * MLP(x row m), and row_weights_M gets a gradient.
  sum_to_rows   instead of out_MD, return out_TD: each row added into the x row it was read
                from (the combine fused into the experts; no [M, D] buffer).
  returns out_MD in x's dtype. Gradients flow to x and every weight; experts without rows get
  exactly zero weight gradients. No host sync on the Triton path.
"""

import torch

from moe.kernels.activations import GATED, check_activation
from moe.kernels.torch_expert_mlp import expert_mlp_fused

BACKENDS = ("auto", "torch", "triton")


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
    row_weights_M=None,
    sum_to_rows=False,
):
    """Run every local expert's MLP over its rows; see the module docstring for the contract."""
    check_activation(activation)
    if activation in GATED and w3_EDF is None:
        raise ValueError(f"activation={activation!r} needs w3")
    if resolve_backend(backend, x_TD) == "triton":
        from moe.kernels.triton.expert_mlp import expert_mlp_triton

        return expert_mlp_triton(
            x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, activation, token_ids_M,
            row_weights_M, sum_to_rows,
        )  # fmt: skip
    return expert_mlp_fused(
        x_TD, offsets_E, w1_EDF, w2_EFD, w3_EDF, b1_EF, b2_ED, activation, token_ids_M,
        row_weights_M, sum_to_rows,
    )  # fmt: skip
