"""Per-device memory estimate of DP x EP training: does a model fit, and by how much.

The model is a config object that satisfies `PlannerModel` (moe/memory/model_counts.py): its
sizes as attributes and `build()`. Parameter counts come from building the model on the meta
device (no memory allocated); activations from moe/memory/activations.py.
Everything else is arithmetic, stated here so it can be checked:

  N_local = dense + expert / ep parameters on one device; b = bytes of `dtype`.
  parameters   N_local * b                     gradients  N_local * b (same dtype)
  optimizer    Adam-like: `optimizer_states` fp32 tensors per parameter (in the parameter
               dtype without master weights) + fp32 master weights (4 B) for b < 4.
               offload="optimizer": only the masters stay on the device; "all": nothing.
  step temps   (foreach step, no offload) one group's share N_local / groups of: AdamW's
               denominator sqrt(v) + eps (state bytes) and, with masters, the fp32 gradient
               copies (4 B). Fused optimizers or offload: 0 on the device.
  activations  moe/memory/activations.py (per micro-batch of s tokens x b sequences).
  comms        MoE all-to-all (ep > 1): send + receive buffers of one layer's routed rows,
               2 * k c s b h * b (x2 hierarchical); gradient all-reduce (world > 1): one flat
               copy of the local gradients (the bucketed reducer keeps every bucket's copy
               until backward finishes), in `grad_comm_dtype`.
Layouts (`data_parallel`, as moe.parallel.parallelize applies them):
  ddp   dense parameters replicated on every device, experts sharded over ep (N_local above).
  fsdp  FSDP2 shards every parameter, gradient and optimizer state over all devices:
        N_shard = (dense + expert) / world. Assumed units: one per MoE layer's experts (over
        dp) and one per transformer block (pass `blocks=` to parallelize), so while a unit
        computes it is gathered whole: parameters N_shard * b + 2 units * b (the current and
        the prefetched one), gradients N_shard * b + 1 unit * b (reduce-scatter input),
        optimizer state on N_shard, comms one unit's reduce-scatter buffer. A unit is the
        larger of one block's dense parameters and one MoE layer's experts / ep.
The total adds the peaks of every category (a conservative bound: the step temporaries and
the end-of-backward gradient buffers do not coincide with the full activations).
"""

from dataclasses import dataclass, field

import torch

from moe.memory.activations import activation_bytes
from moe.memory.model_counts import ParamCounts, PlannerModel, count_parameters

GiB = 2**30


@dataclass
class MemoryEstimate:
    """Per-device bytes by category (see the module docstring for the formulas)."""

    world_size: int
    dp: int
    ep: int
    data_parallel: str
    dtype: str
    offload: str | None
    groups: int
    checkpointing: bool
    total_params: int
    dense_params: int
    expert_params: int
    local_params: int
    parameters: int
    gradients: int
    optimizer_state: int
    step_temporaries: int
    activations: int
    communication: int
    host_bytes: int  # per device: offloaded optimizer state and master/host weight copies
    device_memory_bytes: int
    notes: list[str] = field(default_factory=list)
    # parameters that train (requires_grad: all, or e.g. moe.lora's adapters alone); gradients
    # and optimizer state are counted for these only, the frozen rest as parameters
    trainable_params: int | None = None

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.step_temporaries
            + self.activations
            + self.communication
        )

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory_bytes

    @property
    def headroom(self) -> int:
        """Device bytes left over (negative: short by that much)."""
        return self.device_memory_bytes - self.total

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("step temporaries", self.step_temporaries),
            ("activations", self.activations),
            ("communication", self.communication),
            ("total", self.total),
            ("device memory", self.device_memory_bytes),
            ("headroom", self.headroom),
            ("host memory (offload)", self.host_bytes),
        ]

    def _frozen_text(self) -> str:
        t = self.trainable_params
        return "" if t is None or t == self.total_params else f"; {t:,} trainable, rest frozen"

    def __str__(self) -> str:
        head = (
            f"memory plan: world={self.world_size} (dp={self.dp} x ep={self.ep}), "
            f"layout {self.data_parallel} ({_LAYOUTS[self.data_parallel]}), "
            f"{self.dtype}, offload={self.offload}, groups={self.groups}, "
            f"checkpointing={self.checkpointing}\n"
            f"params: {self.total_params:,} total ({self.dense_params:,} dense, "
            f"{self.expert_params:,} expert); {self.local_params:,} per device"
            f"{self._frozen_text()}\n"
        )
        lines = [f"{'per device':<24}{'GiB':>10}"]
        lines += [f"{name:<24}{value / GiB:>10.2f}" for name, value in self.rows()]
        verdict = "fits" if self.fits else "does NOT fit"
        tail = f"{verdict}: headroom {self.headroom / GiB:.2f} GiB"
        return head + "\n".join(lines) + "\n" + tail + "".join(f"\n  {n}" for n in self.notes)


_LAYOUTS = {
    "ddp": "dense replicated, experts sharded over ep",
    "fsdp": "FSDP2: every parameter, gradient and optimizer state sharded over all devices",
}


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def estimate_memory(
    model_config: PlannerModel,
    *,
    world_size: int,
    dp: int,
    ep: int,
    dtype: torch.dtype = torch.bfloat16,
    offload: str | None = None,
    groups: int = 1,
    checkpointing: bool = False,
    micro_batch_tokens: int | None = None,
    device_memory_bytes: int = 32 * GiB,
    master_weights: bool | None = None,
    optimizer_states: int = 2,
    fused_optimizer: bool = False,
    flash_attention: bool = False,
    dropout: bool = False,
    hierarchical_alltoall: bool = False,
    grad_comm_dtype: torch.dtype | None = None,
    data_parallel: str = "ddp",
) -> MemoryEstimate:
    """Per-device memory of training `model_config` on world_size = dp x ep devices.

    micro_batch_tokens: tokens per device per micro-batch (default one sequence). See the
    module docstring for every formula and its assumptions.
    """
    _check_arguments(model_config, world_size, dp, ep, offload, groups, data_parallel)
    counts = count_parameters(model_config)
    local, unit = _local_params(counts, model_config.n_layers, world_size, ep, data_parallel)
    trained = ParamCounts(  # gradients and optimizer state: the trainable parameters only
        counts.trainable,
        counts.trainable - counts.trainable_expert,
        counts.trainable_expert,
        counts.moe_layers,
    )
    local_t, unit_t = _local_params(trained, model_config.n_layers, world_size, ep, data_parallel)
    b = _bytes(dtype)
    on_device, host, temps = _optimizer_bytes(
        local_t, b, master_weights, optimizer_states, offload, groups, fused_optimizer
    )
    tokens = micro_batch_tokens or model_config.seq_len
    act = activation_bytes(model_config, tokens, b, checkpointing, flash_attention, dropout)
    comm = 0
    if ep > 1 and model_config.num_experts:
        cf = model_config.capacity_factor or 1.0
        comm += int(2 * model_config.top_k * cf * tokens * model_config.d_model * b)
        comm *= 2 if hierarchical_alltoall else 1
    if world_size > 1:  # ddp: a flat copy of the gradients; fsdp: one unit's reduce-scatter
        comm += (unit_t or local_t) * (_bytes(grad_comm_dtype) if grad_comm_dtype else b)
    notes = []
    if offload is not None:
        notes.append(f"offload: {host / GiB:.2f} GiB of host memory per device")
    return MemoryEstimate(
        world_size=world_size,
        dp=dp,
        ep=ep,
        data_parallel=data_parallel,
        dtype=str(dtype).removeprefix("torch."),
        offload=offload,
        groups=groups,
        checkpointing=checkpointing,
        total_params=counts.total,
        dense_params=counts.dense,
        expert_params=counts.expert,
        local_params=local,
        parameters=(local + 2 * unit) * b,
        gradients=(local_t + unit_t) * b,
        optimizer_state=on_device,
        step_temporaries=temps,
        activations=act,
        communication=comm,
        host_bytes=host,
        device_memory_bytes=int(device_memory_bytes),
        notes=notes,
        trainable_params=counts.trainable,
    )


def _check_arguments(
    model_config, world_size: int, dp: int, ep: int, offload, groups: int, data_parallel: str
) -> None:
    """estimate_memory's argument checks: one clear error naming the bad argument."""
    missing = [a for a in (*PlannerModel.__annotations__, "build") if not hasattr(model_config, a)]
    if missing:  # e.g. a transformers config: other attribute names, no build()
        raise TypeError(
            f"estimate_memory: a {type(model_config).__name__} is not a moe.memory.PlannerModel: "
            f"it has no {', '.join(missing)} (wrap it in a config object that has them)"
        )
    if dp * ep != world_size:
        raise ValueError(f"dp={dp} x ep={ep} does not equal world_size={world_size}")
    if offload not in (None, "optimizer", "all"):
        raise ValueError(f"offload={offload!r} is not one of (None, 'optimizer', 'all')")
    if groups <= 0:
        raise ValueError(f"groups must be a positive int, got {groups}")
    if data_parallel not in _LAYOUTS:
        raise ValueError(f"data_parallel={data_parallel!r} is not one of {tuple(_LAYOUTS)}")
    E = model_config.num_experts
    if E and E % ep:
        raise ValueError(f"ep={ep} must divide num_experts={E}")


def _local_params(
    counts: ParamCounts, n_layers: int, world_size: int, ep: int, data_parallel: str
) -> tuple[int, int]:
    """(parameters a device holds, the largest unit fsdp gathers whole while it computes; 0
    under ddp)."""
    if data_parallel != "fsdp":
        return counts.dense + counts.expert // ep, 0
    local = -(-counts.total // world_size)
    per_layer_experts = -(-counts.expert // (max(counts.moe_layers, 1) * ep))
    return local, max(-(-counts.dense // max(n_layers, 1)), per_layer_experts)


def _optimizer_bytes(
    local: int,
    b: int,
    master_weights: bool | None,
    optimizer_states: int,
    offload: str | None,
    groups: int,
    fused_optimizer: bool,
) -> tuple[int, int, int]:
    """(optimizer state + masters on the device, bytes on the host, the step's temporaries)
    for `local` parameters of `b` bytes each."""
    masters = (b < 4) if master_weights is None else master_weights
    state_b = 4 if (masters or b == 4) else b
    state = local * optimizer_states * state_b
    master = local * 4 if masters else 0
    if offload is None:
        on_device, host = state + master, 0
    elif offload == "optimizer":  # device masters stay; host keeps state + a staging copy
        on_device, host = master, state + local * (4 if masters else b)
    else:
        on_device, host = 0, state + local * (4 if masters else b)
    temps = 0
    if offload is None and not fused_optimizer:
        temps = -(-local // groups) * (state_b + (4 if masters else 0))
    return on_device, host, temps


# the names before 2026-12-07, kept one release (CHANGELOG): "plan" is the layout planner's
MemoryPlan = MemoryEstimate
plan_memory = estimate_memory
