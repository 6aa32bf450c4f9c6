"""Routing result, router base class and the registry of routers by name."""

import math
from dataclasses import dataclass

import torch
from torch import nn

ROUTER_CHUNK_BYTES = 4 << 20  # float32 rows of x upcast at a time by the router matmul (CPU)
ROUTER_DEVICE_CHUNKS = 4  # at most this many chunks off the CPU (each costs 6 launches)


def _row_chunks(x_TD: torch.Tensor) -> list[tuple[int, int]]:
    """The row ranges the router matmul upcasts one at a time, so that no float32 copy of the
    whole of x is ever alive: 4 MiB of float32 rows on the CPU; on a GPU, where every chunk is
    6 kernel launches per step (32 chunks at Mixtral: ~190 of the layer's ~330 launches), at
    most ROUTER_DEVICE_CHUNKS (a float32 transient of at most about half x's 16-bit bytes)."""
    T, D = x_TD.shape
    step = max(1, ROUTER_CHUNK_BYTES // (4 * max(D, 1)))
    if x_TD.device.type != "cpu":
        step = max(step, -(-T // ROUTER_DEVICE_CHUNKS))
    return [(i, min(i + step, T)) for i in range(0, T, step)]


class _HalfRouterMatmul(torch.autograd.Function):
    """logits_TE = x_TD @ w_ED^T in float32 for a 16-bit x, upcasting x a chunk of rows at a
    time: the same float32 products as x.float() @ w.float().t(), without a float32 copy of x
    alive (forward) or saved (backward saves x itself, which the layer keeps anyway)."""

    @staticmethod
    def forward(ctx, x_TD, w_ED):
        ctx.save_for_backward(x_TD, w_ED)
        w_f = w_ED.float()
        logits_TE = x_TD.new_empty(x_TD.shape[0], w_ED.shape[0], dtype=torch.float32)
        for a, b in _row_chunks(x_TD):
            torch.mm(x_TD[a:b].float(), w_f.t(), out=logits_TE[a:b])
        return logits_TE

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogits_TE):
        x_TD, w_ED = ctx.saved_tensors
        dlogits_TE = dlogits_TE.float()
        w_f = w_ED.float()
        dx_TD = dw_ED = None
        if ctx.needs_input_grad[0]:
            dx_TD = torch.empty_like(x_TD)
            for a, b in _row_chunks(x_TD):
                dx_TD[a:b] = dlogits_TE[a:b] @ w_f
        if ctx.needs_input_grad[1]:
            dw_f = w_f.new_zeros(w_ED.shape)
            for a, b in _row_chunks(x_TD):
                dw_f.addmm_(dlogits_TE[a:b].t(), x_TD[a:b].float())
            dw_ED = dw_f.to(w_ED.dtype)
        return dx_TD, dw_ED


def router_matmul(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """x @ w^T in float32 (float64 for float64 inputs), autocast off: under bf16 autocast the
    router's matmul would otherwise run in bf16 and change which experts tokens choose. A
    16-bit x is upcast a chunk of rows at a time (no float32 copy of x, kept or saved)."""
    dtype = torch.promote_types(x_TD.dtype, torch.float32)
    device_type = x_TD.device.type if x_TD.device.type in ("cpu", "cuda", "xpu") else "cpu"
    with torch.autocast(device_type, enabled=False):
        if x_TD.dtype in (torch.bfloat16, torch.float16) and x_TD.dim() == 2:
            return _HalfRouterMatmul.apply(x_TD, w_ED)
        return x_TD.to(dtype) @ w_ED.to(dtype).t()


@dataclass
class Routing:
    """What a router decides for T tokens over E experts (all fp32).

    Token choice fills expert_ids_TK / weights_TK (and mask_TK when the router itself declines
    some pairs); expert choice fills token_ids_EC / weights_EC instead.
    """

    logits_TE: torch.Tensor
    probs_TE: torch.Tensor  # scores used for metrics (entropy)
    aux_loss: torch.Tensor  # already weighted by the config's coefficients
    expert_ids_TK: torch.Tensor | None = None
    weights_TK: torch.Tensor | None = None
    mask_TK: torch.Tensor | None = None
    token_ids_EC: torch.Tensor | None = None
    weights_EC: torch.Tensor | None = None


class Router(nn.Module):
    """Linear scorer `weight` [E, d_model] in fp32 math; subclasses pick experts from logits."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.d_model))
        self.reset_parameters()

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError for options this router cannot honour."""

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.config.d_model)
        nn.init.uniform_(self.weight, -bound, bound)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.project(x_TD)

    # The hook a feature registers an additive term on the logits with (set on the router):
    # logit_term(router, x_TD) -> [T, E] in the logits' dtype; None: the plain linear scorer.
    logit_term = None

    def project(self, x_TD: torch.Tensor) -> torch.Tensor:
        """x @ weight^T in fp32 math (router_matmul), plus `logit_term`'s term when one is
        registered: every router's logits come from here."""
        logits_TE = router_matmul(x_TD, self.weight)
        return logits_TE if self.logit_term is None else logits_TE + self.logit_term(self, x_TD)

    replayable = True  # picks top-k experts per token: moe.replay_routing can force them
    # The ranks whose observed loads are summed (bias updates, balance_loss="global"): None in
    # one process; moe.parallel.parallelize sets the world group.
    load_group = None

    @classmethod
    def forced_ids_problem(cls, config, expert_ids_TK: torch.Tensor) -> str | None:
        """Why `expert_ids_TK` cannot be forced on this router (None if it can). Reads values:
        for moe.replay_routing's checks before replay starts, never in a forward."""
        if expert_ids_TK.numel() and not (
            (expert_ids_TK >= 0).all() and (expert_ids_TK < config.num_experts).all()
        ):
            return f"an expert id is outside [0, {config.num_experts})"
        return None

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: torch.Tensor | None = None) -> Routing:
        """Route T tokens. `forced_ids_TK` (router replay) replaces the top-k choice; the
        weights are still the router's own scores at those experts, normalised as usual."""
        raise NotImplementedError
