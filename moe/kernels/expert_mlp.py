"""The whole expert MLP of all local experts: the one entry point GroupedExperts calls.

Contract (every backend; letters of docs/shapes.md, L = this rank's experts, R = their rows):
  x_ND          the expert input: the R rows themselves (N = R), or, when
                rows.gather_ids_R is given, the token rows x_TD (N = T) with expert row r
                x_TD[gather_ids_R[r]] (gathered while the kernels load it).
  offsets_L     int32 cumulative row ends per local expert, on the device; rows at or past
                offsets_L[-1] are dropped pairs and come out exactly zero (no NaN, no garbage).
  w1_LDF, w2_LFD, (w3_LDF for swiglu), optional biases b1_LF, b2_LD.
  rows          ExpertRows (moe/kernels/expert_rows.py): what the dispatcher hands over about
                the rows (gather ids, combine weights folded into the MLP, and whether to sum
                the rows into their tokens).
  returns out_ND in x's dtype: out_RD, or y_TD when rows.sum_to_tokens. Gradients flow to x,
  every weight and rows.row_weights_R; experts without rows get exactly zero weight gradients.
  No host sync on the Triton path.
"""

import torch

from moe._moved import moved_names
from moe.kernels import expert_rows as _rows
from moe.kernels.activations import GATED, check_activation
from moe.names import BACKENDS

FUSES_COMBINE = {"torch": True, "triton": True}  # backend -> applies ExpertRows' combine

# moved to leaf modules (the backends import them; importing them from here was a cycle)
__getattr__ = moved_names(
    __name__,
    {
        "ExpertRows": "moe.kernels.expert_rows.ExpertRows",
        "NO_ROWS_INFO": "moe.kernels.expert_rows.NO_ROWS_INFO",
        "keep_graph": "moe.kernels.saved_tensors.keep_graph",
        "save_for_backward_early_free": "moe.kernels.saved_tensors.save_for_backward_early_free",
        "saved_early": "moe.kernels.saved_tensors.saved_early",
    },
)


def triton_available(x: torch.Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    try:
        from moe.kernels.triton import expert_mlp  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """ "auto" -> "triton" on CUDA with Triton, else "torch"; a named backend is checked."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if triton_available(x) else "torch"
    return backend


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
    backend: str = "auto",
):
    """Run every local expert's MLP over its rows; see the module docstring for the contract.
    `backend` may be "auto" (resolved here) or one already resolved by the caller."""
    check_activation(activation)
    if activation in GATED and w3_LDF is None:
        raise ValueError(f"activation={activation!r} needs w3")
    weights = (w1_LDF, w2_LFD, w3_LDF, b1_LF, b2_LD)
    if resolve_backend(backend, x_ND) == "triton":
        from moe.kernels.triton.expert_mlp import expert_mlp_triton

        return expert_mlp_triton(x_ND, offsets_L, *weights, activation=activation, rows=rows)
    from moe.kernels.torch_expert_mlp import expert_mlp_torch

    return expert_mlp_torch(x_ND, offsets_L, *weights, activation=activation, rows=rows)
