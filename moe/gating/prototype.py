"""M6-T expert prototyping: experts split into k groups, top-1 inside each group."""

import torch

from moe.gating.base import Router, Routing
from moe.gating.losses import load_balance_loss, router_loss
from moe.names import register_router


@register_router("prototype")
class PrototypeRouter(Router):
    """k prototypes of E/k experts each; softmax and top-1 within every prototype, so every
    token gets exactly one expert per prototype and the k outputs are summed (weights
    renormalised over the k when normalize_weights). The balance
    loss is the mean of each prototype's Switch loss."""

    @classmethod
    def check_config(cls, config) -> None:
        if config.num_experts % config.top_k:
            raise ValueError(
                f"router='prototype' needs top_k={config.top_k} (prototypes) to divide "
                f"num_experts={config.num_experts}"
            )

    @classmethod
    def forced_ids_problem(cls, config, expert_ids_TK: torch.Tensor) -> str | None:
        problem = super().forced_ids_problem(config, expert_ids_TK)
        if problem is not None:
            return problem
        group_TK = expert_ids_TK // (config.num_experts // config.top_k)
        if not (group_TK == torch.arange(config.top_k, device=group_TK.device)).all():
            return "choice j of a token must be an expert of prototype j"
        return None

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: torch.Tensor | None = None) -> Routing:
        k, E = self.config.top_k, self.config.num_experts
        logits_TE = self.logits(x_TD)
        T = logits_TE.shape[0]
        probs_TKX = logits_TE.view(T, k, E // k).softmax(-1)
        first_K = torch.arange(k, device=logits_TE.device) * (E // k)
        if forced_ids_TK is None:
            top_TK = probs_TKX.max(-1)
            local_TK, weights_TK = top_TK.indices, top_TK.values
        else:  # router replay: the recorded expert inside each prototype
            local_TK = forced_ids_TK - first_K
            weights_TK = probs_TKX.gather(2, local_TK.unsqueeze(-1)).squeeze(-1)
        ids_TK = local_TK + first_K
        if self.config.normalize_weights:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        balance = (
            sum(load_balance_loss(probs_TKX[:, g], local_TK[:, g : g + 1]) for g in range(k)) / k
        )
        return Routing(
            logits_TE,
            probs_TKX.reshape(T, E) / k,
            router_loss(self.config, logits_TE, balance),
            expert_ids_TK=ids_TK,
            weights_TK=weights_TK,
        )
