"""Auxiliary router losses (unweighted; routers apply the config's coefficients)."""

import torch

from moe.capacity import count_ids


def balance_term(probs_TE: torch.Tensor, counts_E: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """E * sum_e f_e * P_e with f_e = counts_E[e] / num_pairs (pairs routed to e) and P_e the
    mean score of e over the T tokens; 0 (with a graph) for T = 0. The one implementation of
    the batch balance formula: the routers' load_balance_loss and the layer's balance tracker
    (moe.gating.balance) both call it."""
    T, E = probs_TE.shape
    if T == 0:
        return probs_TE.sum() * 0.0
    return E * torch.dot(counts_E.to(probs_TE.dtype) / num_pairs, probs_TE.mean(0))


def load_balance_loss(probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
    """Switch/GShard balance loss E * sum_e f_e * P_e, f_e = pairs to e / (T*k), P_e = mean prob.

    Equals 1 under perfectly uniform routing for any k (Megatron-Core's scaling for k > 1).
    """
    E = probs_TE.shape[1]
    return balance_term(probs_TE, count_ids(expert_ids_TK, E), expert_ids_TK.numel())


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def cv_squared(v_E: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation (Shazeer et al. 2017): var / mean^2."""
    if v_E.numel() <= 1:
        return v_E.sum() * 0.0
    return v_E.var() / (v_E.mean().square() + eps)


def router_loss(config, logits_TE, balance: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of a balance term and the z-loss, per the config's coefficients. With
    balance_loss "sequence" or "global" the layer adds its balance term (moe.gating.balance)."""
    loss = logits_TE.sum() * 0.0
    batch = getattr(config, "balance_loss", "batch") == "batch"
    if balance is not None and config.aux_loss_coef > 0 and batch:
        loss = loss + config.aux_loss_coef * balance
    if config.z_loss_coef > 0:
        loss = loss + config.z_loss_coef * z_loss(logits_TE)
    return loss
