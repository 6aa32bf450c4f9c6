"""MoELayer: route -> map rows and dispatch -> experts -> combine -> record, one seam per stage."""

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from moe.backward_watch import BackwardWatch
from moe.capacity import capacity_factor_for, expert_capacity
from moe.config import MoEConfig
from moe.dispatch.dispatcher import Dispatcher
from moe.dispatch.local import LocalDispatcher
from moe.dispatch.permute import RowMap
from moe.dispatch.replica_split import expert_choice_slot_rows, slot_rows
from moe.dispatch.wire import DIRECTIONS, wire_for
from moe.experts import GroupedExperts, LayerExperts
from moe.gating import Routing, build_router
from moe.gating.balance import BalanceTracker, in_recomputation
from moe.gating.topk import TopKRouter
from moe.kernels.registry import ExpertKernel, kernel_for_layer, kernel_wrappers_for
from moe.kernels.weight_format import weight_format_for
from moe.recompute_frame import recompute_context
from moe.shared_experts import SharedExperts
from moe.slots import guard as replica_guard
from moe.slots.layout import SlotLayout, first_slots, layout_from_state, state_entries


class MoELayer(nn.Module):
    """Drop-in replacement for a transformer FFN: x [..., d_model] -> y of the same shape and
    dtype. After each forward, `aux_loss` holds the weighted router loss and `stats` the
    routing statistics (detached tensors; reading them is the caller's host sync).
    `balance` (a BalanceTracker) holds the balance state across forwards: the loads since the
    last bias update / expert placement and the step's global-balance totals.

    `dispatcher` moves rows to the experts and back (moe.dispatch): LocalDispatcher by
    default; moe.parallel.parallelize installs an ExpertParallelDispatcher from outside.
    """

    route_replay = None  # set by moe.replay_routing: forces the top-k choice (routing_replay)
    route_recorder = None  # set by moe.record_routing: keeps each forward's choice

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
        layout = SlotLayout.of_config(self.config)  # the experts, then R spare slots (copies)
        self.num_slots = layout.num_slots
        self.experts = GroupedExperts(
            layout.num_slots,
            d_model,
            d_ff,
            activation,
            bias,
            kernel_for_layer(self.config),  # backend, or the kernel the settings claim
            device=device,
            dtype=dtype,
            weight_format=weight_format_for(self.config),
            wrappers=kernel_wrappers_for(self.config),  # claimed: around the chosen kernel
        )
        if device is not None:
            self.router.to(device)
        self.shared_experts = _shared_experts(self.config, device, dtype)
        # whether the experts fuse the combine: LayerExperts.fuses_combine (kernel, check_finite)
        self.dispatcher: Dispatcher = LocalDispatcher(wire=wire_for(self.config))
        self.aux_loss = torch.zeros(())
        self.stats: dict[str, torch.Tensor] = {}
        # the ("dp", "ep") mesh moe.parallel.parallelize spread this layer over (None: one device)
        self.mesh: DeviceMesh | None = None
        # what moe.swap_ffn replaced ({"block": path, "kind": ...}; None: built directly)
        self.swapped_from: dict[str, str] | None = None
        self.balance = BalanceTracker(self.config)  # loads, global totals, sequence length
        # The slot layout, kept once (moe.slots.layout.SlotLayout): slot s (row s of
        # experts.w1..., rank s // L under EP) holds canonical expert expert_of_slot_S[s].
        # Routers, stats and loads stay canonical; only the row map uses slots. State
        # dicts carry the keys every version wrote (_state_dict_slots).
        # Its checksum travels with each forward's count exchange under EP: ranks holding
        # different layouts (a load_state_dict on some ranks) are refused before rows move.
        eos = torch.tensor(layout.expert_of_slot, dtype=torch.long, device=device)
        self.register_buffer("expert_of_slot_S", eos, persistent=False)
        check = torch.tensor([layout.checksum()], dtype=torch.long, device=device)
        self.register_buffer("slot_checksum_1", check, persistent=False)
        first = first_slots(eos, self.config.num_experts)  # kept: no forward derives it
        self.register_buffer("_first_slot_E", first, persistent=False)
        self.register_state_dict_post_hook(_state_dict_slots)
        with torch.no_grad():  # spare slots start as copies of experts 0, 1, ... (or none)
            for p in self.experts.parameters():
                layout.fill_copies(p)
        self._backwards = BackwardWatch()
        self._kernel_checked = None  # (kernel, device type, dtype) the last refuse check passed
        self.ran_compiled = False  # set when torch.compile traced a forward (replica_guard)
        # copies' gradients to sum before a step: the backward's mark (None without copies)
        self.replica_mark = replica_guard.watch(self, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.config.d_model
        if x.dim() == 0 or x.shape[-1] != d:
            raise ValueError(f"{self.name}: expected input [..., {d}], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{self.name}: expected a floating-point input, got {x.dtype}")
        x_TD = x.reshape(-1, d)
        self.balance.seq_len = x.shape[-2] if x.dim() > 1 else 1  # balance_loss="sequence"
        if self.config.recompute and self.training and torch.is_grad_enabled():
            y_TD = checkpoint(
                self._forward_tokens, x_TD, use_reentrant=False, context_fn=recompute_context
            )
        else:
            y_TD = self._forward_tokens(x_TD)
        if y_TD.requires_grad and torch.compiler.is_compiling():
            replica_guard.traced(self)  # its copies' gradients watched instead of the mark
        elif y_TD.requires_grad:
            y_TD = self._backwards.watch(y_TD, self.replica_mark)
        # FSDP2 (parallelize) hooks its pre-backward all-gather onto the output, which an
        # in-place op on a view would drop: there, one T x D copy instead of a view
        fsdp = isinstance(self, FSDPModule) and y_TD.requires_grad
        return y_TD.view(x.shape).clone() if fsdp else y_TD.view(x.shape)

    @property
    def replica_grads_pending(self) -> bool:
        """Whether the copies' gradients wait for moe.parallel.sum_replica_grads."""
        return replica_guard.pending(self)

    def replica_grads_summed(self) -> None:
        """moe.parallel.sum_replica_grads summed the copies' gradients: steps may run."""
        replica_guard.summed(self)

    def backward_pending(self) -> bool:
        """Whether a training forward's output still waits for its backward (its graph is
        alive and its gradient not computed): weights must not move then (rebalance)."""
        return self._backwards.pending()

    def _forward_tokens(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The five stages; each is one seam (router, dispatcher, experts, dispatcher, stats)."""
        kernel = self._kernel(x_TD)  # resolved once, checked before any work; handed down
        routing = self._route(x_TD)
        plan = self._row_map(routing, len(x_TD))
        check = self.name if self.config.check_finite else None
        slot_map = self.expert_of_slot() if check else None  # errors name canonical experts
        experts = LayerExperts(self.experts, kernel, check_finite=check, expert_of_slot_S=slot_map)
        # dense: every token, never exchanged (an overlapping dispatcher runs it during one)
        shared = None if self.shared_experts is None else lambda: self.shared_experts(x_TD)
        y_TD, shared_TD = self.dispatcher.run(x_TD, plan, experts, shared)
        y_TD = y_TD.to(x_TD.dtype)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD.to(x_TD.dtype)
        self._record(routing, plan, experts.algorithm)
        return y_TD

    def _kernel(self, x_TD: torch.Tensor) -> ExpertKernel:
        """The experts' kernel; an input it cannot take is one error naming this layer, the
        kernel and the reason, asked again when kernel, device, dtype or weight format change."""
        kernel = self.experts.kernel_for(x_TD)
        key = (kernel, x_TD.device.type, self.experts.w1.dtype, self.experts.weight_format)
        if self._kernel_checked != key:
            with torch.no_grad():  # dtype and format only: nothing saved for a recomputation
                weights = self.experts.weights()  # (which asks no more): built once a forward
            reason = kernel.refuse(x_TD, weights)
            if reason is not None:
                raise ValueError(
                    f"{self.name}: kernel {kernel.name!r} cannot run this layer: {reason}"
                )
            self._kernel_checked = key
        return kernel

    def _route(self, x_TD: torch.Tensor) -> Routing:
        """Router call; moe.replay_routing / moe.record_routing hook in here (routing_replay)."""
        if self.route_replay is None:
            routing = self.router(x_TD)
        else:
            routing = self.route_replay.route(self, x_TD)
        self._check_finite(routing.logits_TE)
        if self.route_recorder is not None and not in_recomputation():
            self.route_recorder.add(routing)
        return routing

    def _row_map(self, routing: Routing, num_tokens: int) -> RowMap:
        """The row map in slots (where the experts' weights sit), from canonical ids;
        copies (spare slots) split by where the dispatcher says this rank sits."""
        c, slot_E, check = self.config, self._first_slot_E, self.slot_checksum_1
        if routing.token_ids_EC is not None:  # expert choice: expert e's tokens -> its slot
            return expert_choice_slot_rows(
                routing.token_ids_EC, routing.weights_EC, num_tokens, slot_of_expert_E=slot_E,
                layout_check_X=check,
            )  # fmt: skip
        factor = capacity_factor_for(c, self.training)
        return slot_rows(
            routing.expert_ids_TK,
            routing.weights_TK,
            routing.mask_TK,
            capacity=expert_capacity(num_tokens, c.num_experts, c.top_k, factor, c.min_capacity),
            drop_policy=c.drop_policy,
            expert_of_slot_S=self.expert_of_slot_S,
            slot_of_expert_E=slot_E,
            candidates=self.dispatcher.copy_candidates,
            layout_check_X=check,
        )

    def _check_finite(self, logits_TE: torch.Tensor) -> None:
        """Router logits must be finite. Compile-safe: under torch.compile or on a GPU this is
        a device-side assert (no Python branch on a tensor value, no host sync)."""
        finite = torch.isfinite(logits_TE).all()
        message = f"{self.name}: router logits contain NaN or Inf (check the layer's input)"
        if torch.compiler.is_compiling() or logits_TE.device.type != "cpu":
            torch._assert_async(finite, message)
        elif not finite:
            raise FloatingPointError(message)

    def _record(self, routing: Routing, plan: RowMap, algorithm: str | None) -> None:
        if in_recomputation():  # checkpointed forward run again in backward: already recorded
            return
        plan = self._canonical_counts(plan)
        probs_TE = routing.probs_TE.detach()
        entropy_T = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1)
        num_pairs = max(plan.token_ids_M.shape[0], 1)
        self.aux_loss = routing.aux_loss
        self.stats = {
            "tokens_per_expert": plan.counts_E.detach(),
            "routed_per_expert": plan.routed_E.detach(),
            "dropped": plan.num_dropped.detach(),
            "dropped_fraction": plan.num_dropped.detach().float() / num_pairs,
            "router_entropy": entropy_T.mean() if entropy_T.numel() else entropy_T.sum(),
            "dead_experts": (plan.counts_E == 0).sum().detach(),
        }
        term, balance_stats = self.balance.record(
            routing, plan, self.training, self.router.load_group
        )
        self.stats.update(balance_stats)  # load_cv, load_max_over_mean (global_balance_loss)
        if term is not None:  # balance_loss "sequence" / "global", weighted
            self.aux_loss = self.aux_loss + term
        if algorithm is not None:  # expert-parallel: 1 when "auto" chose the hierarchical one
            self.stats["a2a_hierarchical"] = torch.tensor(int(algorithm == "hierarchical"))

    def expert_of_slot(self) -> torch.Tensor:
        """[S] the canonical expert each expert slot holds (placement and replicas)."""
        return self.expert_of_slot_S

    @property
    def slot_of_expert_E(self) -> torch.Tensor:
        """[E] each expert's first slot (change the layout with set_slot_layout only)."""
        return self._first_slot_E

    def slot_layout(self) -> SlotLayout:
        """The slots as a host value (a host read: step time, not forward / backward)."""
        return SlotLayout(self.config.num_experts, tuple(self.expert_of_slot_S.tolist()))

    @torch.no_grad()
    def set_slot_layout(self, layout: SlotLayout) -> None:
        """Adopt `layout` (same experts and slots; checked): the buffer changes in place, so
        compiled graphs and the row map see it. Weights do not move (the caller's job)."""
        if (layout.num_experts, layout.num_slots) != (self.config.num_experts, self.num_slots):
            raise ValueError(
                f"{self.name}: a slot layout of {layout.num_experts} experts in "
                f"{layout.num_slots} slots does not fit this layer "
                f"({self.config.num_experts} experts in {self.num_slots} slots)"
            )
        layout.check()
        self.expert_of_slot_S.copy_(torch.tensor(layout.expert_of_slot, dtype=torch.long))
        self._first_slot_E.copy_(first_slots(self.expert_of_slot_S, self.config.num_experts))
        self.slot_checksum_1.fill_(layout.checksum())

    def _canonical_counts(self, plan: RowMap) -> RowMap:
        """The row map's per-slot counts in canonical expert ids (stats, loads): copies summed."""
        E, slot_S = self.config.num_experts, self.expert_of_slot_S
        zeros = plan.counts_E.new_zeros(E)
        return dataclasses.replace(
            plan,
            counts_E=zeros.index_add(0, slot_S, plan.counts_E),
            routed_E=zeros.index_add(0, slot_S, plan.routed_E),
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, *args):
        """The layout keys are checked before anything of this layer loads (a placement must
        be a permutation of the experts, a replica layout fit this layer's slots); a state
        dict without a placement (saved before placements existed) is in canonical order."""
        layout = layout_from_state(self.name, state_dict, prefix, self.config)
        keys = (prefix + "slot_of_expert_E", prefix + "expert_of_slot_S")
        if layout is None and strict:  # a layer with copies needs its layout
            missing.extend(keys)
        others = {k: v for k, v in state_dict.items() if k not in keys}
        super()._load_from_state_dict(others, prefix, local_metadata, strict, missing, *args)
        if layout is not None:
            self.set_slot_layout(layout)

    # The balance tracker's state, under the names users and moe.parallel read on the layer.
    @property
    def load_since_update(self) -> torch.Tensor | None:
        """Pairs routed to each expert (canonical ids) since the last update_router_biases."""
        return self.balance.load_since_update

    @load_since_update.setter
    def load_since_update(self, value: torch.Tensor | None) -> None:
        self.balance.load_since_update = value

    @property
    def load_since_rebalance(self) -> torch.Tensor | None:
        """Rows each expert computed (canonical ids) since the last rebalance_experts."""
        return self.balance.load_since_rebalance

    @load_since_rebalance.setter
    def load_since_rebalance(self, value: torch.Tensor | None) -> None:
        self.balance.load_since_rebalance = value

    @property
    def global_balance(self):
        """This step's GlobalBalance (balance_loss="global"), or None."""
        return self.balance.global_balance

    def extra_repr(self) -> str:
        """Routing, and the kernel / weight and row formats when the settings chose them."""
        c, kernel = self.config, kernel_for_layer(self.config)
        text = f"name={self.name}, router={c.router}, top_k={c.top_k}, "
        text += f"capacity_factor={c.capacity_factor}"
        text += "" if isinstance(kernel, str) else f", kernel={kernel.name} ({kernel.selected_by})"
        text += "" if c.weight_format == "dense" else f", weight_format={c.weight_format}"
        rows = [f"{d}={f.name}" for d, f in zip(DIRECTIONS, wire_for(c).formats) if not f.plain]
        return text + (f", rows on the wire: {' '.join(rows)}" if rows else "")


def _shared_experts(config: MoEConfig, device, dtype) -> SharedExperts | None:
    """The dense shared experts every token passes through (None: num_shared_experts = 0)."""
    if not config.num_shared_experts:
        return None
    d_ff = config.shared_d_ff or config.d_ff * config.num_shared_experts
    return SharedExperts(
        config.d_model,
        d_ff,
        config.activation,
        config.shared_expert_gate,
        config.bias,
        device=device,
        dtype=dtype,
    )


def _state_dict_slots(layer: MoELayer, state_dict: dict, prefix: str, metadata) -> None:
    """State dicts keep the keys every version wrote (moe.slots.layout.state_entries; the
    layer holds the layout once: expert_of_slot_S, not persistent)."""
    for key, value in state_entries(layer.expert_of_slot_S, layer.slot_of_expert_E).items():
        state_dict[prefix + key] = value


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
    load routed in every training forward since the previous call (all micro-batches of the
    step, summed over the router's load_group), then reset that count. Call once per optimizer
    step, outside autograd, so a recomputed (checkpointed) forward routes exactly as the
    original did."""
    for _, layer in moe_layers(model):
        router = layer.router
        load_E = layer.balance.take_load_since_update()
        if isinstance(router, TopKRouter):  # the routers with an expert bias
            if load_E is None:  # no training forward here: still join the all-reduce
                load_E = torch.zeros_like(router.expert_bias)
            load_E = load_E.float()
            if router.load_group is not None:
                torch.distributed.all_reduce(load_E, group=router.load_group)
            router.update_bias(load_E)
