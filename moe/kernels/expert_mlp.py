"""The whole expert MLP of all local experts: the one entry point GroupedExperts calls.

Contract (every backend; letters of docs/shapes.md, L = this rank's experts, R = their rows):
  x_ND          the expert input: the R rows themselves (N = R), or, when
                rows.gather_ids_R is given, the token rows x_TD (N = T) with expert row r
                x_TD[gather_ids_R[r]] (gathered while the kernels load it).
  offsets_L     int32 cumulative row ends per local expert, on the device; rows at or past
                offsets_L[-1] are dropped pairs and come out exactly zero (no NaN, no garbage).
  w1_LDF, w2_LFD, (w3_LDF for swiglu), optional biases b1_LF, b2_LD.
  rows          ExpertRows: what the dispatcher hands over about the rows (gather ids, combine
                weights folded into the MLP, and whether to sum the rows into their tokens).
  returns out_ND in x's dtype: out_RD, or y_TD when rows.sum_to_tokens. Gradients flow to x,
  every weight and rows.row_weights_R; experts without rows get exactly zero weight gradients.
  No host sync on the Triton path.
"""

from dataclasses import dataclass

import torch

from moe.kernels.activations import GATED, check_activation

BACKENDS = ("auto", "torch", "triton")
FUSES_COMBINE = {"torch": True, "triton": True}  # backend -> applies ExpertRows' combine


@dataclass(frozen=True, kw_only=True)
class ExpertRows:
    """The dispatch context's fields the experts read (DispatchContext.expert_rows()).

    gather_ids_R: x is the un-gathered token matrix x_TD and expert row r is
        x_TD[gather_ids_R[r]] (gather on load: no [R, D] copy is written, kept or re-read).
    row_weights_R: each row's combine weight; out row r is row_weights_R[r] * MLP(row r), and
        row_weights_R gets a gradient.
    sum_to_tokens: return y_TD instead of out_RD, each row added into the token it was read
        from (the combine fused into the experts; no [R, D] output). Without gather_ids_R
        row r is token r.
    all_rows_kept: every row handed over is one to compute (R = offsets_L[-1]: no dropped tail),
        as with the rows an expert-parallel exchange delivers; the experts then skip zeroing a
        tail that cannot exist (on CUDA that would be a masked pass over every output row).
    """

    gather_ids_R: torch.Tensor | None = None
    row_weights_R: torch.Tensor | None = None
    sum_to_tokens: bool = False
    all_rows_kept: bool = False


NO_ROWS_INFO = ExpertRows()  # plain rows: no gather, no weights, out_RD returned


def keep_graph() -> bool:
    """backward(retain_graph=True) is running: saved state must survive this backward (the
    expert ops release their pre-activations early otherwise)."""
    try:
        return torch._C._autograd._get_current_graph_task_keep_graph()
    except RuntimeError:  # not inside an engine-run backward (tracing)
        return False


def save_for_backward_early_free(ctx, inputs: tuple, pre: tuple) -> None:
    """Save `inputs` and the pre-activation tensors `pre` of an expert op for its backward.

    Without saved-tensor hooks, `pre` stays on ctx (detached: no cycle through the graph), so
    the backward can free it as soon as its activation step has read it (see `saved_early`).
    When hooks are installed (activation checkpointing, torch.autograd.graph.save_on_cpu), `pre`
    goes through save_for_backward like the inputs, so the hooks see it: dropped and recomputed,
    or moved to the host, instead of held on the device until backward."""
    pre = tuple(t.detach() for t in pre)
    hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    ctx.save_for_backward(*inputs, *(pre if hooked else ()))
    ctx.pre_on_ctx = None if hooked else pre
    ctx.num_saved_inputs = len(inputs)


def saved_early(ctx) -> tuple[tuple, tuple]:
    """(inputs, pre) as saved by `save_for_backward_early_free`; the ctx reference to pre is
    dropped here (unless the graph is retained), so pre dies when the caller lets it go."""
    saved = ctx.saved_tensors
    inputs, pre = saved[: ctx.num_saved_inputs], saved[ctx.num_saved_inputs :]
    if ctx.pre_on_ctx is not None:
        pre = ctx.pre_on_ctx
        if not keep_graph():
            ctx.pre_on_ctx = None
    return inputs, pre


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
    rows: ExpertRows = NO_ROWS_INFO,
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
