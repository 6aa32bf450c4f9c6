"""Auxiliary router losses (unweighted; routers apply the config's coefficients)."""

import torch

from moe.dispatch.capacity import count_ids


def load_balance_loss(probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
    """Switch/GShard balance loss E * sum_e f_e * P_e, f_e = pairs to e / (T*k), P_e = mean prob.

    Equals 1 under perfectly uniform routing for any k (Megatron-Core's scaling for k > 1).
    """
    T, E = probs_TE.shape
    if T == 0:
        return probs_TE.sum() * 0.0
    counts_E = count_ids(expert_ids_TK, E).to(probs_TE.dtype)
    frac_E = counts_E / expert_ids_TK.numel()
    return E * torch.dot(frac_E, probs_TE.mean(0))


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
