"""GShard top-2: the second expert is dispatched with probability 2 * g2 (random routing)."""

import torch

from moe.gating.base import Router, Routing
from moe.gating.losses import load_balance_loss, router_loss
from moe.names import register_router


@register_router("gshard")
class GShardRouter(Router):
    """Softmax top-2 with gates renormalised over the two; in training the second expert is
    kept with probability min(1, 2 * g2) (GShard's random routing). Balance loss counts top-1
    assignments only: E * sum_e mean_prob_e * frac_top1_e."""

    @classmethod
    def check_config(cls, config) -> None:
        if config.top_k != 2:
            raise ValueError(f"router='gshard' is top-2; got top_k={config.top_k}")

    @classmethod
    def forced_ids_problem(cls, config, expert_ids_TK: torch.Tensor) -> str | None:
        """Replayed ids may hold ~e (= -1 - e) in the second column: expert e, which random
        routing declined (recorded so, replayed as declined; the gates still use e's score)."""
        declined_TK = torch.zeros_like(expert_ids_TK, dtype=torch.bool)
        declined_TK[:, 1:] = expert_ids_TK[:, 1:] < 0
        return super().forced_ids_problem(
            config, torch.where(declined_TK, ~expert_ids_TK, expert_ids_TK)
        )

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: torch.Tensor | None = None) -> Routing:
        logits_TE = self.logits(x_TD)
        probs_TE = logits_TE.softmax(-1)
        if forced_ids_TK is None:
            top_TK = probs_TE.topk(2, dim=-1)
            ids_TK, values_TK = top_TK.indices, top_TK.values
        else:  # router replay: choice and random-routing mask (~e: declined) as recorded
            ids_TK = torch.where(forced_ids_TK >= 0, forced_ids_TK, ~forced_ids_TK)
            values_TK = probs_TE.gather(1, ids_TK)
        gates_TK = values_TK / values_TK.sum(-1, keepdim=True).clamp_min(1e-20)
        mask_TK = torch.ones_like(gates_TK, dtype=torch.bool)
        if forced_ids_TK is not None:
            mask_TK = forced_ids_TK >= 0
        elif self.training:
            keep_second_T = torch.rand_like(gates_TK[:, 1]) < 2.0 * gates_TK[:, 1]
            mask_TK[:, 1] = keep_second_T
        balance = load_balance_loss(probs_TE, ids_TK[:, :1])
        return Routing(
            logits_TE,
            probs_TE,
            router_loss(self.config, logits_TE, balance),
            expert_ids_TK=ids_TK,
            weights_TK=gates_TK * mask_TK,
            mask_TK=mask_TK,
        )
