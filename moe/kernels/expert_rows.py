"""ExpertRows: what a dispatcher tells the expert MLP about its rows (a leaf: the entry point
moe/kernels/expert_mlp.py and every backend import it, none imports them back)."""

from dataclasses import dataclass

import torch


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
    token_rows_TK: with gather_ids_R, each token's k rows (the inverse of gather_ids_R: the row
        map's pair_rows_TK; rows at or past offsets_L[-1] are dropped pairs), so a kernel that
        sums rows into tokens reads them directly instead of rebuilding the inverse map (a sort
        and a search over the R row ids) in its forward and again in its backward.
    """

    gather_ids_R: torch.Tensor | None = None
    row_weights_R: torch.Tensor | None = None
    sum_to_tokens: bool = False
    all_rows_kept: bool = False
    token_rows_TK: torch.Tensor | None = None


NO_ROWS_INFO = ExpertRows()  # plain rows: no gather, no weights, out_RD returned
