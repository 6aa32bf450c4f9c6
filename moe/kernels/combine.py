"""Weighted gather-sum of each token's k expert outputs (no scatter, no float atomics)."""

import torch


class _Combine(torch.autograd.Function):
    """Forward: gather each token's k rows and take their weighted sum. Backward: the row
    gradient is a permutation write (each row belongs to exactly one pair), the weight
    gradient a row-wise dot product; no zero-fill, no scatter-add."""

    @staticmethod
    def forward(ctx, out_MD, pair_rows_TK, weights_TK):
        T, K = pair_rows_TK.shape
        rows_TKD = out_MD.index_select(0, pair_rows_TK.reshape(-1)).view(T, K, out_MD.shape[1])
        w_TK = weights_TK.to(out_MD.dtype)
        ctx.save_for_backward(rows_TKD, pair_rows_TK, w_TK)
        ctx.weights_dtype, ctx.num_rows = weights_TK.dtype, out_MD.shape[0]
        return torch.bmm(w_TK.unsqueeze(1), rows_TKD).squeeze(1)

    @staticmethod
    def backward(ctx, dy_TD):
        rows_TKD, pair_rows_TK, w_TK = ctx.saved_tensors
        d_out = d_w = None
        if ctx.needs_input_grad[0]:
            scaled_TKD = w_TK.unsqueeze(-1) * dy_TD.unsqueeze(1)
            d_out = scaled_TKD.new_empty(ctx.num_rows, dy_TD.shape[1])
            d_out.index_copy_(0, pair_rows_TK.reshape(-1), scaled_TKD.flatten(0, 1))
        if ctx.needs_input_grad[2]:
            acc = torch.promote_types(rows_TKD.dtype, torch.float32)
            d_w = (rows_TKD * dy_TD.unsqueeze(1)).sum(-1, dtype=acc)
            d_w = d_w.to(ctx.weights_dtype)
        return d_out, None, d_w


def combine_torch(out_MD: torch.Tensor, pair_rows_TK: torch.Tensor, weights_TK: torch.Tensor):
    """y[t] = sum_j weights_TK[t, j] * out_MD[pair_rows_TK[t, j]].

    pair_rows_TK is a permutation of out_MD's rows (every row belongs to one pair). Dropped
    pairs carry weight 0 and point at a zero row, so they contribute exactly zero. Gradients
    flow to out_MD and weights_TK (the router's combine weights).
    """
    return _Combine.apply(out_MD, pair_rows_TK, weights_TK)


def combine(out_MD, pair_rows_TK, weights_TK, backend: str = "torch"):
    if backend == "triton":
        from moe.kernels.triton.combine import combine_triton

        return combine_triton(out_MD, pair_rows_TK, weights_TK)
    return combine_torch(out_MD, pair_rows_TK, weights_TK)
