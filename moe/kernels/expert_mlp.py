"""The expert MLP of all local experts: the contract every kernel (moe/kernels/registry.py)
implements, and `expert_mlp`, the functional form for tests and benchmarks (GroupedExperts
calls its resolved kernel object directly).

Contract (every kernel; letters of docs/shapes.md, L = this rank's experts, R = their rows):
  x_ND          the expert input: the R rows themselves (N = R), or, when
                rows.gather_ids_R is given, the token rows x_TD (N = T) with expert row r
                x_TD[gather_ids_R[r]] (gathered while the kernels load it).
  offsets_L     int32 cumulative row ends per local expert, on the device; rows at or past
                offsets_L[-1] are dropped pairs and come out exactly zero (no NaN, no garbage).
  weights       ExpertWeights (moe/kernels/expert_weights.py): w1_LDF, w2_LFD, (w3_LDF for
                swiglu), optional biases b1_LF, b2_LD, scales and a format tag.
  rows          ExpertRows (moe/kernels/expert_rows.py): what the dispatcher hands over about
                the rows (gather ids, combine weights folded into the MLP, and whether to sum
                the rows into their tokens).
  returns out_ND in x's dtype: out_RD, or y_TD when rows.sum_to_tokens. Gradients flow to x,
  every weight and rows.row_weights_R; experts without rows get exactly zero weight gradients.
  No host sync on the Triton path.
"""

import warnings

import torch

from moe.kernels import expert_rows as _rows
from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.registry import ExpertKernel, resolve_kernel
from moe.names import BACKENDS

__all__ = ["BACKENDS", "expert_mlp", "resolve_backend"]


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The name of the kernel backend=`backend` runs for input x ("auto" -> "triton" on CUDA
    with Triton, else "torch"); an unknown name is a ValueError."""
    return resolve_kernel(backend, x.device).name


def expert_mlp(
    x_ND,
    offsets_L,
    w1_LDF,
    w2_LFD,
    w3_LDF=None,
    b1_LF=None,
    b2_LD=None,
    *,
    activation: str = "gelu",
    rows: _rows.ExpertRows = _rows.NO_ROWS_INFO,
    kernel: "str | ExpertKernel" = "auto",
    backend: str | None = None,
):
    """Run every local expert's MLP over its rows on `kernel` (a registered name, "auto", or
    an ExpertKernel); see the module docstring for the contract. `backend=` is the old name of
    `kernel=` (a DeprecationWarning; removed in 0.2)."""
    if backend is not None:
        warnings.warn(
            "expert_mlp(backend=) is deprecated and removed in 0.2: use kernel=",
            DeprecationWarning,
            stacklevel=2,
        )
        kernel = backend
    weights = ExpertWeights(w1_LDF, w2_LFD, w3_LDF, b1_LF, b2_LD)
    run = resolve_kernel(kernel, x_ND.device)
    return run(x_ND, offsets_L, weights, activation=activation, rows=rows)
