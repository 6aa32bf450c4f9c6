"""The balance tracker of an MoE layer: balance losses beyond one batch, balance metrics, and
the load accumulated for bias updates and expert placement.

MoEConfig.balance_loss picks the balance term (weighted by aux_loss_coef):
- "batch": E * sum_i f_i P_i over the layer's tokens (the router computes it; Switch/GShard).
- "sequence": DeepSeek-V3's sequence-wise loss: the same term per sequence, averaged over the
  sequences. A sequence is the second-to-last dim of the layer input x [..., S, d_model]
  (x [B, S, d] -> B sequences of S tokens; x [T, d] is one sequence of T tokens).
- "global": f_i from the token counts of every micro-batch of the step on every rank (the
  router's load_group, set by moe.parallel.parallelize): see GlobalBalance. In eval mode the
  layer's own batch is used (no communication: eval forwards need not run on every rank).
Only for the "topk" and "switch" routers, whose balance term is exactly this formula.

Who computes what: a router's batch term is part of its own routing (each router has its own
formula: cv^2 for noisy_topk, top-1 only for gshard, per prototype), so the router returns it
in Routing.aux_loss; the terms that need state beyond one batch (the sequences of the input,
the step's totals) and the loads counted across forwards live in BalanceTracker, which the
layer owns (`layer.balance`). Both use moe.gating.losses.balance_term for E * sum_i f_i P_i.
"""

import torch
import torch.distributed as dist
from torch import nn

from moe.gating.losses import balance_term
from moe.names import BALANCE_LOSSES, SEQUENCE_ROUTERS  # noqa: F401  (re-exported)


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


def _moved(t: torch.Tensor, fn) -> torch.Tensor:
    """`fn` (from nn.Module._apply) applied to `t` for its device only: a dtype cast such as
    model.to(torch.bfloat16) must not round counts or float64 totals."""
    moved = fn(t)
    return moved if moved.dtype == t.dtype else t.to(moved.device)


class BalanceTracker(nn.Module):
    """The balance state of one MoE layer (`layer.balance`), declared here and nowhere else.

    State, all in canonical expert ids and counted in training forwards only (a forward
    recomputed by activation checkpointing is not counted: the layer skips it):
    - `load_since_update`: long [E] or None, pairs routed to each expert since the last
      moe.update_router_biases (which takes it and resets it to None).
    - `load_since_rebalance`: long [E] or None, kept pairs (rows each expert computed) since
      the last moe.parallel.rebalance_experts (which resets it).
    - `global_balance`: GlobalBalance or None, the running totals of balance_loss="global"
      for the current step (moe.reset_global_balance resets it).
    - `seq_len`: tokens per sequence of the layer's last input (balance_loss="sequence"),
      set by MoELayer.forward; None: the whole batch is one sequence.

    The tensors are step-scoped accumulators, not model state, so they are attributes rather
    than buffers: buffers would enter named_buffers(), which parallelize broadcasts and
    compares across ranks and checkpoint round trips compare, and state_dict() if persistent
    (old checkpoints lack them). They still move with the layer: `_apply` (.to(), .cuda(),
    ...) moves them to the new device and keeps their dtype (a model.to(bfloat16) cast
    leaves counts and float64 totals exact).
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.load_since_update: torch.Tensor | None = None
        self.load_since_rebalance: torch.Tensor | None = None
        self.global_balance: GlobalBalance | None = None
        self.seq_len: int | None = None

    def record(self, routing, plan, training: bool, group=None):
        """After one forward: count the loads (training), and return (the weighted sequence /
        global balance term to add to the layer's aux_loss, or None; balance statistics for
        layer.stats). `group`: the ranks whose loads "global" sums (the router's load_group)."""
        c = self.config
        stats = balance_metrics(plan.routed_E)
        if training:
            self._count(plan)
        if c.balance_loss == "batch" or routing.expert_ids_TK is None:
            return None, stats
        # computed in the original forward only (it counts and communicates): its saved
        # tensors are kept as they are, not handed to a surrounding checkpoint
        # (MoEConfig.recompute), whose recompute skips this and would otherwise find fewer
        # tensors saved than the original forward (a CheckpointError)
        with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            term = self._term(routing, plan, training, group, stats)
        return (c.aux_loss_coef * term if c.aux_loss_coef > 0 else None), stats

    def _term(self, routing, plan, training: bool, group, stats: dict) -> torch.Tensor:
        c = self.config
        probs_TE = routing.probs_TE
        if c.balance_loss == "sequence":
            T = probs_TE.shape[0]
            seq_len = T if self.seq_len is None else self.seq_len
            term = sequence_balance_loss(probs_TE, routing.expert_ids_TK, seq_len)
        elif not training:  # eval: this batch alone, no communication, step state untouched
            term = balance_term(probs_TE, plan.routed_E, probs_TE.shape[0] * c.top_k)
        else:
            if self.global_balance is None:
                self.global_balance = GlobalBalance(c.num_experts, c.top_k, plan.routed_E.device)
            term = self.global_balance.loss(probs_TE, plan.routed_E, group)
            stats["global_balance_loss"] = self.global_balance.step_value()
        return term

    def _count(self, plan) -> None:
        routed_E = plan.routed_E.detach()  # pairs routed (before capacity): bias updates
        previous = self.load_since_update
        self.load_since_update = routed_E if previous is None else previous + routed_E
        kept_E = plan.counts_E.detach()  # rows each expert computed: expert placement
        previous = self.load_since_rebalance
        self.load_since_rebalance = kept_E if previous is None else previous + kept_E

    def take_load_since_update(self) -> torch.Tensor | None:
        """The load since the last bias update (None: no training forward since), reset."""
        load_E, self.load_since_update = self.load_since_update, None
        return load_E

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in ("load_since_update", "load_since_rebalance"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, _moved(t, fn))
        if self.global_balance is not None:
            self.global_balance.totals = _moved(self.global_balance.totals, fn)
        return self

    def extra_repr(self) -> str:
        return f"balance_loss={self.config.balance_loss}"


def reset_global_balance(model) -> None:
    """Start a new step of the global-batch balance loss: call after each optimizer step."""
    for module in model.modules():
        if isinstance(module, BalanceTracker):
            module.global_balance = None


def _kept(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor kept as is (the innermost saved_tensors_hooks win over a checkpoint's)."""
    return t
