"""Top-k token-choice router: softmax or sigmoid scores, group-limited choice, and
aux-loss-free balancing by a per-expert bias (DeepSeek-V3)."""

import torch

from moe.gating.base import Router, Routing
from moe.gating.losses import load_balance_loss, router_loss
from moe.names import register_router


def scores_from_logits(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    return logits_TE.softmax(-1) if score_func == "softmax" else logits_TE.sigmoid()


def limit_to_groups(choice_TE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Keep only experts in each token's best `topk_groups` groups (others -> -inf).

    A group's score is the sum of its top-2 expert scores (DeepSeek-V3 node-limited routing).
    """
    T, E = choice_TE.shape
    grouped_TGX = choice_TE.view(T, num_groups, E // num_groups)
    top = min(2, E // num_groups)
    group_scores_TG = grouped_TGX.topk(top, dim=-1).values.sum(-1)
    best_group_ids = group_scores_TG.topk(topk_groups, dim=-1).indices
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_group_ids, True)
    keep_TE = keep_TG.repeat_interleave(E // num_groups, dim=1)
    return choice_TE.masked_fill(~keep_TE, float("-inf"))


@register_router("topk")
class TopKRouter(Router):
    """Each token picks its top-k experts.

    softmax_before_topk=True: weights are the softmax probabilities of the chosen experts
    (optionally renormalised); False: top-k on logits, softmax over the k. Sigmoid scores are
    chosen on s + bias and weighted by s (normalised over the k when normalize_weights).
    """

    def __init__(self, config):
        super().__init__(config)
        # Aux-loss-free balancing: biases only the choice, never the weights.
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def choose(self, logits_TE: torch.Tensor, forced_ids_TK: torch.Tensor | None = None):
        c = self.config
        scores_TE = scores_from_logits(logits_TE, c.score_func)
        if forced_ids_TK is not None:  # router replay: the choice is given, weights are ours
            ids_TK = forced_ids_TK
        else:
            if c.score_func == "softmax" and not c.softmax_before_topk:
                choice_TE = logits_TE + self.expert_bias
            else:
                choice_TE = scores_TE + self.expert_bias
            if c.num_groups > 1:
                choice_TE = limit_to_groups(choice_TE, c.num_groups, c.topk_groups)
            ids_TK = choice_TE.topk(c.top_k, dim=-1).indices
        if c.score_func == "softmax" and not c.softmax_before_topk:
            weights_TK = logits_TE.gather(1, ids_TK).softmax(-1)
        else:
            weights_TK = scores_TE.gather(1, ids_TK)
            if c.normalize_weights:
                weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True).clamp_min(1e-20)
        return scores_TE, ids_TK, weights_TK * c.route_scale

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: torch.Tensor | None = None) -> Routing:
        logits_TE = self.logits(x_TD)
        scores_TE, ids_TK, weights_TK = self.choose(logits_TE, forced_ids_TK)
        probs_TE = scores_TE if self.config.score_func == "softmax" else _normalised(scores_TE)
        balance = load_balance_loss(probs_TE, ids_TK)
        return Routing(
            logits_TE,
            probs_TE,
            router_loss(self.config, logits_TE, balance),
            expert_ids_TK=ids_TK,
            weights_TK=weights_TK,
        )

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """bias += rate * sign(mean load - load), re-centred to zero mean (no host sync)."""
        rate = self.config.bias_update_rate
        if rate <= 0:
            return
        load_E = load_E.float()
        self.expert_bias += rate * torch.sign(load_E.mean() - load_E)
        self.expert_bias -= self.expert_bias.mean()


def _normalised(scores_TE: torch.Tensor) -> torch.Tensor:
    return scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)


@register_router("switch")
class SwitchRouter(TopKRouter):
    """Switch Transformer top-1: multiplicative input jitter in training, weight = raw prob."""

    @classmethod
    def check_config(cls, config) -> None:
        if config.top_k != 1:
            raise ValueError(f"router='switch' is top-1; got top_k={config.top_k}")

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        x_TD = x_TD.to(torch.promote_types(x_TD.dtype, torch.float32))
        eps = self.config.jitter_eps
        if self.training and eps > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - eps, 1.0 + eps)
        return self.project(x_TD)


__all__ = ["SwitchRouter", "TopKRouter"]
