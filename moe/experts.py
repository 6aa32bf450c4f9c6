"""GroupedExperts: the stacked weights of the experts on this rank, computed in one call."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moe.dispatch.dispatcher import DispatchContext, ExpertFn
from moe.kernels.activations import GATED, check_activation
from moe.kernels.expert_rows import NO_ROWS_INFO, ExpertRows
from moe.kernels.expert_weights import ExpertWeights
from moe.kernels.registry import ExpertKernel, KernelWrapper, resolve_kernel
from moe.kernels.weight_format import DENSE, WeightFormat
from moe.shards import local


class GroupedExperts(nn.Module):
    """The L expert MLPs of this rank: w1 [L, D, F], w2 [L, F, D] (+ w3 [L, D, F] for gated
    activations), optional biases b1 [L, F], b2 [L, D]. The parameters keep the plain names
    w1/w2/w3/b1/b2 (not w1_LDF...): they are state-dict keys that checkpoints and from_hf /
    to_hf rely on; docs/shapes.md gives their shapes.

    `expert_offset` is the global id of the first local expert (non-zero under expert
    parallelism). Initialised like nn.Linear so each expert matches a dense FFN's scale.
    `weight_format` (moe.kernels.weight_format) sets the stored weights up once and builds
    what the kernel gets (`weights()`).
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        activation: str = "gelu",
        bias: bool = False,
        backend: "str | ExpertKernel" = "auto",
        expert_offset: int = 0,
        num_global_experts: int | None = None,
        device=None,
        dtype=None,
        weight_format: WeightFormat = DENSE,
        wrappers: tuple[KernelWrapper, ...] = (),
    ):
        super().__init__()
        check_activation(activation)
        kw = {"device": device, "dtype": dtype}
        self.activation, self.backend = activation, backend
        # the kernel `backend` names with `wrappers` around it (the layer's claimed kernel
        # wrappers), resolved at the first call (kernel_for) and held here
        self.wrappers = wrappers
        self.kernel: ExpertKernel | None = None
        self._kernel_key: tuple | None = None
        self.d_model, self.d_ff = d_model, d_ff
        self.expert_offset = expert_offset
        self.num_global_experts = num_global_experts or num_experts
        # parallelize() records this rank's count here (w1 is then a global DTensor); None: w1's
        self.num_local_experts: int | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model, **kw))
        self.w3 = (
            nn.Parameter(torch.empty(num_experts, d_model, d_ff, **kw))
            if activation in GATED
            else None
        )
        self.b1 = nn.Parameter(torch.empty(num_experts, d_ff, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model, **kw)) if bias else None
        self.reset_parameters()
        self.weight_format = weight_format
        weight_format.setup(self)

    @property
    def num_experts(self) -> int:
        """Experts held on this rank (parallelize() records it: w1 is then a global DTensor)."""
        return self.w1.shape[0] if self.num_local_experts is None else self.num_local_experts

    def reset_parameters(self) -> None:
        for w, b, fan_in in (
            (self.w1, self.b1, self.d_model),
            (self.w3, None, self.d_model),
            (self.w2, self.b2, self.d_ff),
        ):
            bound = 1.0 / math.sqrt(fan_in)
            for t in (w, b):
                if t is not None and t.device.type != "meta":
                    nn.init.uniform_(t, -bound, bound)

    def kernel_for(self, x: torch.Tensor) -> ExpertKernel:
        """The kernel these experts run on x's device, resolved once from `backend` (a name,
        "auto" or an ExpertKernel) with `wrappers` around it and held in `self.kernel`: again
        only when a call comes on another device type than the one it was resolved for (a
        layer moved to CUDA after its first call) or the wrappers changed. The layer calls
        this once per call and hands the object down."""
        key = (x.device.type, self.backend, self.wrappers)
        if self.kernel is None or self._kernel_key != key:
            self.kernel = resolve_kernel(self.backend, x.device, self.wrappers)
            self._kernel_key = key
        return self.kernel

    def forward(
        self,
        x_ND: torch.Tensor,
        offsets_L: torch.Tensor | None,
        *,
        rows: ExpertRows = NO_ROWS_INFO,
        kernel: ExpertKernel | None = None,
        compute: Callable | None = None,
    ) -> torch.Tensor:
        """Rows of each local expert (expert-major; int32 row ends offsets_L) -> their MLP
        outputs out_ND (out_RD, tail rows past offsets_L[-1] exactly 0; or y_TD). The experts
        only compute.

        x_ND is the R rows, or the token rows x_TD when rows.gather_ids_R is set (gather on
        load); rows (ExpertRows, the DispatchContext's `rows`) also carries the combine
        weights and sum_to_tokens (return y_TD). kernel: resolved by the layer (once per
        call; `kernel_for`), else resolved here.
        Under parallelize() the weights are DTensors sharded over "ep": compute on this rank's
        experts (autograd flows back into the DTensor, as in torchtitan).
        compute: returns compute(x_ND, self.weights()) instead, for a dispatcher that calls
        the experts in parts (`mlp` with slices of those weights) within this one module call,
        so FSDP2's hooks gather and reduce the weights once (LayerExperts.call_once).
        """
        if compute is not None:
            return compute(x_ND, self.weights())
        return self.mlp(x_ND, offsets_L, self.weights(), rows=rows, kernel=kernel)

    def weights(self) -> ExpertWeights:
        """This rank's expert weights as the kernel reads them (the weight format builds them
        from the local shards of DTensors)."""
        return self.weight_format.weights(self)

    def mlp(
        self,
        x_ND: torch.Tensor,
        offsets_L: torch.Tensor,
        weights: ExpertWeights,
        *,
        rows: ExpertRows = NO_ROWS_INFO,
        kernel: ExpertKernel | None = None,
    ) -> torch.Tensor:
        """The expert MLP with `weights` (weights(), a slice of it, or leaves made from it);
        forward's contract otherwise."""
        run = kernel or self.kernel_for(x_ND)
        x_ND = x_ND.to(weights.dtype)
        return run(x_ND, offsets_L, weights, activation=self.activation, rows=rows)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}/{self.num_global_experts} "
            f"(first={self.expert_offset}), d_model={self.d_model}, d_ff={self.d_ff}, "
            f"activation={self.activation}"
        )


@dataclass(eq=False)
class LayerExperts(ExpertFn):
    """The layer's GroupedExperts for one layer call, as every dispatcher calls them: on the
    kernel the layer resolved (`kernel`, also the one whose combine the dispatchers use),
    each output checked when the layer's MoEConfig.check_finite is on (`check_finite` = the
    layer's name, for the error), and the all-to-all algorithm that brought the rows
    (ctx.algorithm) kept for the layer's stats."""

    module: GroupedExperts
    kernel: ExpertKernel
    check_finite: str | None = None
    # with check_finite: the layer's slot -> canonical expert map, so errors name experts
    expert_of_slot_S: torch.Tensor | None = None
    algorithm: str | None = None  # set by each call: ctx.algorithm

    @property
    def fuses_combine(self) -> bool:
        """The one place the fuse is decided: the kernel can, and check_finite (which names
        experts from their output rows) does not need the rows."""
        return self.kernel.fuses_combine and self.check_finite is None

    @property
    def takes_row_weights(self) -> bool:
        """Whether the rows may come weighted by the combine weights (the kernel's say)."""
        return self.kernel.takes_row_weights

    def __call__(self, x_ND, offsets_L, ctx: DispatchContext) -> torch.Tensor:
        out_ND = self.module(x_ND, offsets_L, rows=ctx.rows, kernel=self.kernel)
        return self._seen(out_ND, offsets_L, ctx)

    def call_once(self, x: torch.Tensor, compute: Callable) -> torch.Tensor:
        return self.module(x, None, compute=compute)

    def part(
        self, x_RD, offsets_L, ctx: DispatchContext, weights: ExpertWeights, first: int
    ) -> torch.Tensor:
        ends_L = offsets_L[first : first + weights.num_experts]
        out_RD = self.module.mlp(x_RD, ends_L, weights, rows=ctx.rows, kernel=self.kernel)
        return self._seen(out_RD, offsets_L, ctx)

    def _seen(self, out_ND, offsets_L, ctx: DispatchContext) -> torch.Tensor:
        self.algorithm = ctx.algorithm
        if self.check_finite is not None:
            check_experts_finite(
                self.check_finite, self.module, out_ND, offsets_L, self.expert_of_slot_S
            )
        return out_ND


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters of every GroupedExperts: sharded over "ep", replicated over "dp"."""
    return [
        (f"{n}.{pn}" if n else pn, p)
        for n, m in model.named_modules()
        if isinstance(m, GroupedExperts)
        for pn, p in m.named_parameters(recurse=False)
    ]


def dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every other parameter: replicated on all ranks."""
    experts = {id(p) for _, p in expert_parameters(model)}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in experts]


def is_expert_parameter(model: nn.Module, param: torch.Tensor) -> bool:
    return any(p is param for _, p in expert_parameters(model))


def check_experts_finite(
    layer_name: str,
    experts: GroupedExperts,
    out_RD: torch.Tensor,
    offsets_L: torch.Tensor,
    expert_of_slot_S: torch.Tensor | None = None,
) -> None:
    """Debug check (MoEConfig.check_finite): raise FloatingPointError naming the layer, the
    canonical ids of experts whose weights or output rows hold NaN or Inf, and the global
    slots that hold them (expert_of_slot_S: the layer's slot -> expert map under a placement
    or replicas; None: slot = expert). Reads device values (a host sync), so it is off by
    default."""
    bad_L = torch.zeros(experts.num_experts, dtype=torch.bool, device=out_RD.device)
    for _, p in experts.named_parameters(recurse=False):
        bad_L |= ~torch.isfinite(local(p.detach())).flatten(1).all(1)
    rows = torch.arange(out_RD.shape[0], device=out_RD.device)
    expert_R = torch.searchsorted(offsets_L.to(rows.dtype), rows, right=True)
    bad_R = ~torch.isfinite(out_RD.detach()).all(1) & (expert_R < experts.num_experts)
    bad_L |= torch.bincount(expert_R[bad_R], minlength=experts.num_experts + 1)[:-1] > 0
    if bool(bad_L.any()):
        slots = bad_L.nonzero().flatten() + experts.expert_offset
        ids = slots if expert_of_slot_S is None else expert_of_slot_S.to(slots.device)[slots]
        raise FloatingPointError(
            f"{layer_name}: NaN or Inf in the weights or outputs of expert(s) "
            f"{sorted(set(ids.tolist()))} (slots {slots.tolist()})"
        )
