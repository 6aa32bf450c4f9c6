"""The combine's one home: every sum of expert rows back into their tokens.

- `combine` / `moe::combine`: the weighted gather-sum of each token's k expert outputs (no
  scatter, no float atomics; the Triton variant is moe/kernels/triton/combine.py, each kernel's
  `ExpertKernel.combine` picks one), used by the dispatchers whose experts return rows
  (moe.dispatch.weighted_sum_rows).
- `rows_into_tokens`: the plain sum of (already weighted) rows into their tokens, called inside
  both expert-MLP ops when the experts fuse the combine (ExpertRows.sum_to_tokens) and by the
  torch op's input gradient.
- `sum_rows`: its differentiable form, LocalDispatcher's combine when the experts return rows.
"""

import torch


@torch.library.custom_op("moe::combine", mutates_args=())
def _combine_op(
    out_MD: torch.Tensor, pair_rows_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """Gather each token's k rows and take their weighted sum (in out_MD's dtype)."""
    T, K = pair_rows_TK.shape
    rows_TKD = out_MD.index_select(0, pair_rows_TK.reshape(-1)).view(T, K, out_MD.shape[1])
    w_TK = weights_TK.to(out_MD.dtype)
    return torch.bmm(w_TK.unsqueeze(1), rows_TKD).squeeze(1)


@_combine_op.register_fake
def _(out_MD, pair_rows_TK, weights_TK):
    return out_MD.new_empty(pair_rows_TK.shape[0], out_MD.shape[1])


def _setup_context(ctx, inputs, output):
    out_MD, pair_rows_TK, weights_TK = inputs
    ctx.save_for_backward(out_MD, pair_rows_TK, weights_TK)


def _backward(ctx, dy_TD):
    """The row gradient is a permutation write (each row belongs to exactly one pair), the
    weight gradient a row-wise dot product; no scatter-add. Written with differentiable torch
    ops so double backward (gradcheck of gradients) works too."""
    out_MD, pair_rows_TK, weights_TK = ctx.saved_tensors
    T, K = pair_rows_TK.shape
    flat_rows = pair_rows_TK.reshape(-1)
    d_out = d_w = None
    if ctx.needs_input_grad[0]:
        w_TK = weights_TK.to(out_MD.dtype)
        scaled_TKD = w_TK.unsqueeze(-1) * dy_TD.unsqueeze(1)
        # every row of out_MD belongs to exactly one pair: no zero-fill needed
        d_out = scaled_TKD.new_empty(out_MD.shape[0], dy_TD.shape[1])
        d_out.index_copy_(0, flat_rows, scaled_TKD.flatten(0, 1))
    if ctx.needs_input_grad[2]:
        rows_TKD = out_MD.index_select(0, flat_rows).view(T, K, out_MD.shape[1])
        acc = torch.promote_types(out_MD.dtype, torch.float32)
        d_w = (rows_TKD * dy_TD.unsqueeze(1)).sum(-1, dtype=acc).to(weights_TK.dtype)
    return d_out, None, d_w


_combine_op.register_autograd(_backward, setup_context=_setup_context)


def combine_torch(out_MD: torch.Tensor, pair_rows_TK: torch.Tensor, weights_TK: torch.Tensor):
    """y[t] = sum_j weights_TK[t, j] * out_MD[pair_rows_TK[t, j]].

    pair_rows_TK is a permutation of out_MD's rows (every row belongs to one pair). Dropped
    pairs carry weight 0 and point at a zero row, so they contribute exactly zero. Gradients
    flow to out_MD and weights_TK (the router's combine weights).
    """
    return _combine_op(out_MD, pair_rows_TK, weights_TK)


combine = combine_torch  # a kernel's own combine: ExpertKernel.combine (moe/kernels/registry.py)


def rows_into_tokens(
    rows_nD: torch.Tensor,
    ids_n: torch.Tensor,
    num_tokens: int,
    live_rows: torch.Tensor | None = None,
    into_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_TD[t] = sum of rows_nD[i] over the i with ids_n[i] == t (plain, no autograd), only
    rows i < live_rows (a 0-d device tensor; default all; CPU callers pass live rows only), without
    float atomics: on CPU index_add_ is one thread adding in index order; on CUDA the Triton
    gather-sum over the stable sort of ids (fp32 accumulation); CUDA without Triton falls back
    to index_add_, deterministic only under torch.use_deterministic_algorithms(True).
    into_TD (CPU only): add into this [T, D] tensor in place and return it (chunks of rows
    accumulating into one output)."""
    if rows_nD.device.type == "cpu":
        if into_TD is None:
            into_TD = rows_nD.new_zeros(num_tokens, rows_nD.shape[1])
        return into_TD.index_add_(0, ids_n, rows_nD)
    try:
        from moe.kernels.triton.gather_sum import rows_to_tokens
    except ImportError:
        return rows_nD.new_zeros(num_tokens, rows_nD.shape[1]).index_add_(0, ids_n, rows_nD)
    if live_rows is None:
        live_rows = torch.full((), rows_nD.shape[0], dtype=torch.int64, device=rows_nD.device)
    return rows_to_tokens(rows_nD.contiguous(), ids_n, live_rows, num_tokens)


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_nD, ids_n, num_tokens):
        ctx.save_for_backward(ids_n)
        return rows_into_tokens(rows_nD, ids_n, num_tokens)

    @staticmethod
    def backward(ctx, dy_TD):
        (ids_n,) = ctx.saved_tensors
        return dy_TD.index_select(0, ids_n), None, None


def sum_rows(rows_nD: torch.Tensor, ids_n: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Differentiable rows_into_tokens: each row added into its token; backward gathers."""
    return _SumRows.apply(rows_nD, ids_n, num_tokens)
