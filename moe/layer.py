"""MoELayer: route -> dispatch -> (exchange) -> experts -> (exchange) -> combine."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe.config import MoEConfig
from moe.dispatch.capacity import expert_capacity
from moe.dispatch.permute import (
    DispatchPlan,
    combine_rows,
    gather_tokens,
    plan_expert_choice,
    plan_token_choice,
)
from moe.experts import GroupedExperts
from moe.gating import Routing, build_router
from moe.kernels.expert_mlp import resolve_backend


class MoELayer(nn.Module):
    """Drop-in replacement for a transformer FFN: x [..., d_model] -> y of the same shape and
    dtype. After each forward, `aux_loss` holds the weighted router loss and `stats` the
    routing statistics (detached tensors; reading them is the caller's host sync).

    Expert parallelism is applied from outside (moe.parallel.parallelize sets `exchange`).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = None,
        router: str = "topk",
        activation: str = "gelu",
        bias: bool = False,
        *,
        name: str = "moe",
        device=None,
        dtype=None,
        **options,
    ):
        super().__init__()
        self.config = MoEConfig(
            d_model=d_model,
            d_ff=d_ff,
            num_experts=num_experts,
            top_k=top_k,
            capacity_factor=capacity_factor,
            router=router,
            activation=activation,
            bias=bias,
            **options,
        )
        self.name = name
        self.router = build_router(self.config)
        self.experts = GroupedExperts(
            num_experts,
            d_model,
            d_ff,
            activation,
            bias,
            self.config.backend,
            device=device,
            dtype=dtype,
        )
        if device is not None:
            self.router.to(device)
        self.exchange = None  # expert-parallel exchange, installed by moe.parallel
        self.aux_loss = torch.zeros(())
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.config.d_model
        if x.dim() == 0 or x.shape[-1] != d:
            raise ValueError(f"{self.name}: expected input [..., {d}], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{self.name}: expected a floating-point input, got {x.dtype}")
        x_TD = x.reshape(-1, d)
        if self.config.checkpoint and self.training and torch.is_grad_enabled():
            y_TD = checkpoint(self._forward_tokens, x_TD, use_reentrant=False)
        else:
            y_TD = self._forward_tokens(x_TD)
        return y_TD.view(x.shape)

    def _forward_tokens(self, x_TD: torch.Tensor) -> torch.Tensor:
        routing = self.router(x_TD)
        self._check_finite(routing.logits_TE)
        plan = self._plan(routing, x_TD.shape[0])
        backend = resolve_backend(self.config.backend, x_TD)
        if self.exchange is not None:
            out_MD = self.exchange(x_TD, plan, self.experts)
        elif backend == "triton":  # the kernel gathers token rows as it loads them
            out_MD = self.experts(x_TD, plan.offsets_E, plan.token_ids_M)
        else:
            out_MD = self.experts(gather_tokens(x_TD, plan), plan.offsets_E)
        self._check_expert_outputs(out_MD, plan.offsets_E)
        y_TD = combine_rows(out_MD, plan, backend)
        self._record(routing, plan)
        return y_TD.to(x_TD.dtype)

    def _plan(self, routing: Routing, num_tokens: int) -> DispatchPlan:
        c = self.config
        if routing.token_ids_EC is not None:
            return plan_expert_choice(routing.token_ids_EC, routing.weights_EC, num_tokens)
        factor = c.capacity_factor
        if not self.training and c.eval_capacity_factor is not None:
            factor = c.eval_capacity_factor
        capacity = expert_capacity(num_tokens, c.num_experts, c.top_k, factor, c.min_capacity)
        return plan_token_choice(
            routing.expert_ids_TK,
            routing.weights_TK,
            c.num_experts,
            capacity,
            c.drop_policy,
            routing.mask_TK,
        )

    def _check_finite(self, logits_TE: torch.Tensor) -> None:
        """Router logits must be finite; with config.check_finite also every expert weight.
        Compile-safe: under torch.compile the checks are torch._assert_async (no Python branch
        on a tensor value); on CUDA they never sync the host."""
        checks = [(torch.isfinite(logits_TE).all(), "router logits contain NaN or Inf (check "
                   "the layer's input)")]  # fmt: skip
        if self.config.check_finite:
            ex = self.experts
            for pname in ("w1", "w2", "w3", "b1", "b2"):
                w = getattr(ex, pname, None)
                if w is not None:
                    checks.append(self._expert_finite(w.detach(), f"weight {pname}"))
        for ok, message in checks:
            self._raise_unless(ok, f"{self.name}: {message}", logits_TE)

    def _check_expert_outputs(self, out_MD: torch.Tensor, offsets_E: torch.Tensor) -> None:
        """config.check_finite: NaN/Inf in an expert's output rows raises naming the expert."""
        if not self.config.check_finite:
            return
        rows = torch.arange(out_MD.shape[0], device=out_MD.device, dtype=offsets_E.dtype)
        expert_M = torch.searchsorted(offsets_E, rows, right=True)
        bad_M = ~torch.isfinite(out_MD.detach()).all(-1)
        counts = torch.bincount(expert_M[bad_M], minlength=offsets_E.shape[0] + 1)
        bad_E = counts[: offsets_E.shape[0]] > 0
        ok, message = self._expert_finite(bad_E.logical_not().unsqueeze(-1), "output", bad_E)
        self._raise_unless(ok, f"{self.name}: {message}", out_MD)

    def _expert_finite(self, w_E: torch.Tensor, what: str, bad_E: torch.Tensor | None = None):
        """(all finite?, message naming the first bad expert in eager CPU mode)."""
        if bad_E is None:
            bad_E = ~torch.isfinite(w_E).flatten(1).all(-1)
        ok = ~bad_E.any()
        message = f"expert {what} contains NaN or Inf"
        if not torch.compiler.is_compiling() and w_E.device.type == "cpu" and not ok:
            first = int(bad_E.nonzero()[0, 0]) + getattr(self.experts, "expert_offset", 0)
            message = f"expert {first} {what} contains NaN or Inf"
        return ok, message

    @staticmethod
    def _raise_unless(ok: torch.Tensor, message: str, like: torch.Tensor) -> None:
        if torch.compiler.is_compiling() or like.device.type != "cpu":
            torch._assert_async(ok, message)  # device-side assert: no host sync
        elif not ok:
            raise FloatingPointError(message)

    def _record(self, routing: Routing, plan: DispatchPlan) -> None:
        probs_TE = routing.probs_TE.detach()
        entropy_T = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1)
        num_pairs = max(plan.num_rows, 1)
        self.aux_loss = routing.aux_loss
        self.stats = {
            "tokens_per_expert": plan.counts_E.detach(),
            "routed_per_expert": plan.routed_E.detach(),
            "dropped": plan.num_dropped.detach(),
            "dropped_fraction": plan.num_dropped.detach().float() / num_pairs,
            "router_entropy": entropy_T.mean() if entropy_T.numel() else entropy_T.sum(),
            "dead_experts": (plan.counts_E == 0).sum().detach(),
        }

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"name={self.name}, router={c.router}, top_k={c.top_k}, "
            f"capacity_factor={c.capacity_factor}"
        )


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """Every MoELayer in `model`, with its qualified name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of every MoE layer's aux_loss from the last forward (0 if the model has none)."""
    losses = [m.aux_loss for _, m in moe_layers(model)]
    if not losses:
        return torch.zeros(())
    device = next((t.device for t in losses if t.device.type != "cpu"), losses[0].device)
    return torch.stack([t.to(device) for t in losses]).sum()


@torch.no_grad()
def update_router_biases(model: nn.Module) -> None:
    """Aux-loss-free balancing step (DeepSeek-V3): nudge each router's expert bias toward the
    load observed in the last forward. Call once per optimizer step, outside autograd, so a
    recomputed (checkpointed) forward routes exactly as the original did."""
    for _, layer in moe_layers(model):
        router = layer.router
        if hasattr(router, "update_bias") and "routed_per_expert" in layer.stats:
            load_E = layer.stats["routed_per_expert"].float()
            group = getattr(router, "load_group", None)
            if group is not None:
                torch.distributed.all_reduce(load_E, group=group)
            router.update_bias(load_E)
