"""Weighted gather-sum of each token's k expert outputs (no scatter, no float atomics)."""

import torch


def combine_torch(out_MD: torch.Tensor, pair_rows_TK: torch.Tensor, weights_TK: torch.Tensor):
    """y[t] = sum_j weights_TK[t, j] * out_MD[pair_rows_TK[t, j]].

    Dropped pairs carry weight 0 and point at a zero row, so they contribute exactly zero.
    Gradients flow to out_MD and weights_TK (the router's combine weights).
    """
    T, K = pair_rows_TK.shape
    rows_TKD = out_MD.index_select(0, pair_rows_TK.reshape(-1)).view(T, K, -1)
    w_T1K = weights_TK.to(out_MD.dtype).unsqueeze(1)
    return torch.bmm(w_T1K, rows_TKD).squeeze(1)


def combine(out_MD, pair_rows_TK, weights_TK, backend: str = "torch"):
    if backend == "triton":
        from moe.kernels.triton_combine import combine_triton

        return combine_triton(out_MD, pair_rows_TK, weights_TK)
    return combine_torch(out_MD, pair_rows_TK, weights_TK)
