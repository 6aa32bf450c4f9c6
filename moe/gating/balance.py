"""Balance losses beyond one batch, balance metrics, and the load accumulated for bias updates.

MoEConfig.balance_loss picks the balance term (weighted by aux_loss_coef):
- "batch": E * sum_i f_i P_i over the layer's tokens (the router computes it; Switch/GShard).
- "sequence": DeepSeek-V3's sequence-wise loss: the same term per sequence, averaged over the
  sequences. A sequence is the second-to-last dim of the layer input x [..., S, d_model]
  (x [B, S, d] -> B sequences of S tokens; x [T, d] is one sequence of T tokens).
- "global": f_i from the token counts of every micro-batch of the step on every rank (the
  router's load_group, set by moe.parallel.parallelize): see GlobalBalance. In eval mode the
  layer's own batch is used (no communication: eval forwards need not run on every rank).
Only for the "topk" and "switch" routers, whose balance term is exactly this formula.
"""

import torch
import torch.distributed as dist

BALANCE_LOSSES = ("batch", "sequence", "global")
SEQUENCE_ROUTERS = ("topk", "switch")


def sequence_balance_loss(
    probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Mean over sequences of E * sum_i f_i P_i, with f_i = pairs to i / (S*k) and P_i the mean
    score of expert i, both within the sequence (T = sequences * seq_len tokens)."""
    T, E = probs_TE.shape
    K = expert_ids_TK.shape[1]
    if T == 0:
        return probs_TE.sum() * 0.0
    if seq_len <= 0 or T % seq_len:
        raise ValueError(f"{T} tokens are not whole sequences of {seq_len}")
    B = T // seq_len
    ones_BP = torch.ones(B, seq_len * K, dtype=probs_TE.dtype, device=probs_TE.device)
    counts_BE = probs_TE.new_zeros(B, E).scatter_add_(1, expert_ids_TK.reshape(B, -1), ones_BP)
    mean_probs_BE = probs_TE.view(B, seq_len, E).mean(1)
    return E * (counts_BE / (seq_len * K) * mean_probs_BE).sum(-1).mean()


class GlobalBalance:
    """Running state of the global-batch balance loss of one layer (Megatron-Core's
    global_aux_loss semantics; reset by moe.reset_global_balance after each optimizer step).

    At micro-batch m of the step, every rank of `group` all-reduces (pair counts per expert,
    detached score sums per expert, tokens): one all-reduce of 2E+1 numbers per layer per
    micro-batch (counts of later micro-batches do not exist yet when this one's backward
    runs, so the step total cannot be waited for). N_i and T_run are the sums over micro-batches
    1..m and all ranks; the loss on rank r is

        E * sum_i N_i / (k * T_run) * (W * sum_{t on r} p_ti) / T_m

    with T_m the tokens of micro-batch m on all W ranks. Averaged over ranks (what data-parallel
    gradient averaging does) it is exactly the single-process loss of the concatenation of the
    ranks' micro-batch m with counts N (for m = 1: the "batch" loss of that concatenation).
    `step_value()` = E * sum_i N_i / (k * T_run) * P_i with P_i = all scores summed / T_run:
    the balance loss of the step's whole global batch (detached; for logging).
    """

    def __init__(self, num_experts: int, top_k: int, device):
        self.top_k = top_k
        self.totals = torch.zeros(2 * num_experts + 1, dtype=torch.float64, device=device)

    def loss(self, probs_TE: torch.Tensor, routed_E: torch.Tensor, group) -> torch.Tensor:
        E = probs_TE.shape[1]
        sums_E = probs_TE.sum(0)
        tokens = torch.full((1,), probs_TE.shape[0], device=probs_TE.device)
        packed = torch.cat([routed_E.to(sums_E), sums_E.detach(), tokens.to(sums_E)]).double()
        world = 1
        if group is not None and dist.is_initialized():
            dist.all_reduce(packed, group=group)
            world = dist.get_world_size(group)
        self.totals += packed
        counts_E, tokens_run = self.totals[:E], self.totals[-1].clamp_min(1)
        f_E = (counts_E / (self.top_k * tokens_run)).to(sums_E.dtype)
        P_E = sums_E * (world / packed[-1].clamp_min(1).to(sums_E.dtype))
        return E * torch.dot(f_E, P_E)

    def step_value(self) -> torch.Tensor:
        E = (self.totals.numel() - 1) // 2
        tokens = self.totals[-1].clamp_min(1)
        return E * torch.dot(self.totals[:E] / (self.top_k * tokens), self.totals[E:-1] / tokens)


def load_balance_term(probs_TE: torch.Tensor, routed_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """E * sum_i f_i P_i of one batch from its routed pair counts (the "batch" formula)."""
    T, E = probs_TE.shape
    f_E = routed_E.to(probs_TE.dtype) / max(T * top_k, 1)
    return E * torch.dot(f_E, probs_TE.mean(0) if T else probs_TE.sum(0))


def balance_metrics(routed_E: torch.Tensor) -> dict[str, torch.Tensor]:
    """Coefficient of variation (std / mean) and max / mean of the load per expert (0 when no
    token was routed); detached tensors, no host sync."""
    load_E = routed_E.detach().float()
    mean = load_E.mean()
    safe = mean.clamp_min(1e-20)
    std = load_E.std(correction=0) if load_E.numel() > 1 else load_E.sum() * 0.0
    routed = mean > 0
    zero = torch.zeros_like(mean)
    return {
        "load_cv": torch.where(routed, std / safe, zero),
        "load_max_over_mean": torch.where(routed, load_E.max() / safe, zero),
    }


def in_recomputation() -> bool:
    """True while autograd runs a forward again (activation checkpointing in backward): such a
    forward must not count tokens or communicate a second time."""
    if torch.compiler.is_compiling():  # traced once; the graph itself never recomputes
        return False
    return torch._C._current_graph_task_id() != -1


def record_balance(layer, routing, plan) -> None:
    """After a forward of `layer`: add the sequence/global balance term to layer.aux_loss, the
    balance metrics to layer.stats, and (in training) the routed load to the load accumulated
    since the last moe.update_router_biases and the kept load to the load accumulated since
    the last moe.parallel.rebalance_experts (both in canonical expert ids)."""
    c = layer.config
    layer.stats.update(balance_metrics(plan.routed_E))
    if layer.training:
        load_E = plan.routed_E.detach()
        previous = getattr(layer, "load_since_update", None)
        layer.load_since_update = load_E if previous is None else previous + load_E
        # Rows each expert computed (kept pairs) since moe.parallel.rebalance_experts last ran
        kept_E = plan.counts_E.detach()
        previous = getattr(layer, "load_since_rebalance", None)
        layer.load_since_rebalance = kept_E if previous is None else previous + kept_E
    if c.balance_loss == "batch" or routing.expert_ids_TK is None:
        return
    if c.balance_loss == "sequence":
        shape = getattr(layer, "tokens_shape", None)
        seq_len = shape[-1] if shape else routing.probs_TE.shape[0]
        term = sequence_balance_loss(routing.probs_TE, routing.expert_ids_TK, seq_len)
    elif not layer.training:  # eval: this batch alone, no communication, step state untouched
        term = load_balance_term(routing.probs_TE, plan.routed_E, c.top_k)
    else:
        if getattr(layer, "global_balance", None) is None:
            layer.global_balance = GlobalBalance(c.num_experts, c.top_k, plan.routed_E.device)
        group = getattr(layer.router, "load_group", None)
        term = layer.global_balance.loss(routing.probs_TE, plan.routed_E, group)
        layer.stats["global_balance_loss"] = layer.global_balance.step_value()
    if c.aux_loss_coef > 0:
        layer.aux_loss = layer.aux_loss + c.aux_loss_coef * term


def reset_global_balance(model) -> None:
    """Start a new step of the global-batch balance loss: call after each optimizer step."""
    for module in model.modules():
        if getattr(module, "global_balance", None) is not None:
            module.global_balance = None
