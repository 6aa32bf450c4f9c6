"""Expert choice routing (Zhou et al. 2022): each expert takes its top-C tokens."""

import torch

from moe.capacity import capacity_factor_for, expert_capacity
from moe.gating.base import Router, Routing
from moe.gating.losses import router_loss
from moe.names import register_router


@register_router("expert_choice")
class ExpertChoiceRouter(Router):
    """Softmax over experts; expert e takes the C tokens with the highest probability for it.
    A token may be taken by 0 or several experts. No balance loss (balanced by construction);
    not for causal decoding (the choice looks at the whole batch)."""

    replayable = False  # experts choose tokens: there is no per-token top-k choice to force

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: torch.Tensor | None = None) -> Routing:
        if forced_ids_TK is not None:
            raise ValueError("router='expert_choice' does not support router replay")
        c = self.config
        logits_TE = self.logits(x_TD)
        probs_TE = logits_TE.softmax(-1)
        factor = capacity_factor_for(c, self.training)
        if factor is None:  # dropless has no meaning here: each expert takes k * T / E tokens
            factor = float(c.top_k)
        # the capacity formula of token choice with k = 1 (a token at most once per expert)
        # and no min_capacity floor: C = min(T, ceil(factor * T / E))
        C = expert_capacity(x_TD.shape[0], c.num_experts, 1, factor, min_capacity=0)
        top_EC = probs_TE.t().topk(C, dim=-1)
        return Routing(
            logits_TE,
            probs_TE,
            router_loss(c, logits_TE),
            token_ids_EC=top_EC.indices,
            weights_EC=top_EC.values,
        )
