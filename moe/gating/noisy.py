"""Noisy top-k gating (Shazeer et al. 2017) with the importance + load balance losses."""

import torch
import torch.nn.functional as F
from torch import nn

from moe.gating.base import Router, Routing, router_matmul
from moe.gating.losses import cv_squared, router_loss
from moe.names import register_router


@register_router("noisy_topk")
class NoisyTopKRouter(Router):
    """logits + randn * softplus(x @ w_noise) in training; softmax over the top-k logits.

    Balance term: cv^2(importance) + cv^2(load), load from the smooth estimator
    P(token, e) = Phi((clean_e - threshold) / noise_std_e).
    """

    def __init__(self, config):
        super().__init__(config)
        self.w_noise = nn.Parameter(torch.zeros(config.num_experts, config.d_model))

    @classmethod
    def check_config(cls, config) -> None:
        if config.top_k >= config.num_experts:
            raise ValueError("router='noisy_topk' needs top_k < num_experts (load estimator)")

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: torch.Tensor | None = None) -> Routing:
        k = self.config.top_k
        clean_TE = self.logits(x_TD)
        if self.training:
            std_TE = F.softplus(router_matmul(x_TD, self.w_noise)) + 1e-2
            noisy_TE = clean_TE + torch.randn_like(clean_TE) * std_TE
        else:
            noisy_TE = clean_TE
        top_TK1 = noisy_TE.topk(k + 1, dim=-1)
        if forced_ids_TK is None:
            ids_TK = top_TK1.indices[:, :k]
            weights_TK = top_TK1.values[:, :k].softmax(-1)
        else:  # router replay: softmax of the (noisy) logits at the recorded experts
            ids_TK = forced_ids_TK
            weights_TK = noisy_TE.gather(1, ids_TK).softmax(-1)
        gates_TE = torch.zeros_like(clean_TE).scatter(1, ids_TK, weights_TK)
        importance_E = gates_TE.sum(0)
        if self.training:
            in_thresh_T1 = top_TK1.values[:, k : k + 1]
            out_thresh_T1 = top_TK1.values[:, k - 1 : k]
            normal = torch.distributions.Normal(0.0, 1.0, validate_args=False)  # no host sync
            p_in = normal.cdf((clean_TE - in_thresh_T1) / std_TE)
            p_out = normal.cdf((clean_TE - out_thresh_T1) / std_TE)
            load_E = torch.where(noisy_TE > in_thresh_T1, p_in, p_out).sum(0)
        else:
            load_E = (gates_TE > 0).float().sum(0)
        balance = cv_squared(importance_E) + cv_squared(load_E)
        return Routing(
            clean_TE,
            clean_TE.softmax(-1),
            router_loss(self.config, clean_TE, balance),
            expert_ids_TK=ids_TK,
            weights_TK=weights_TK,
        )
