"""Exact parameter counts of a config built on the meta device, and its per-device memory
plan for a cluster: nothing is allocated, so the 1T model plans on a laptop."""

from __future__ import annotations

import math

import torch

import moe
from examples.m6.config import M6Config
from examples.m6.model import count_params

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
GiB = 2**30
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def default_ep(cfg: M6Config, world_size: int) -> int:
    """Largest EP size dividing both the world and the experts (1 for dense models)."""
    return math.gcd(world_size, cfg.num_experts) if cfg.is_moe else 1


def check_layout(cfg: M6Config, world_size: int, dp: int, ep: int) -> None:
    """Clear errors for a (dp, ep) layout that cannot hold this config."""
    if ep < 1 or dp < 1:
        raise ValueError(f"dp={dp} and ep={ep} must be >= 1")
    if world_size % ep:
        raise ValueError(f"ep={ep} does not divide the world size {world_size}")
    if dp * ep != world_size:
        raise ValueError(
            f"dp={dp} x ep={ep} = {dp * ep} does not equal the world size {world_size}"
        )
    if ep > 1 and not cfg.is_moe:
        raise ValueError(f"ep={ep} needs an MoE config; {cfg.name} is dense")
    if cfg.is_moe and cfg.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={cfg.num_experts} of {cfg.name}")


def static_memory(
    dense: int, experts: int, ep: int, dtype: str, offload: str | None, groups: int
) -> dict[str, float]:
    """Bytes per device for weights, gradients and AdamW state (fp32 master + m + v for
    half precision), activations excluded: the floor any plan has to fit."""
    w = DTYPE_BYTES[dtype]
    params = dense + experts // ep
    opt_bytes = (8 + (4 if w < 4 else 0)) * params
    weights, grads = w * params, w * params
    host = 0
    if offload in ("optimizer", "all"):
        host += opt_bytes
        opt_bytes = 0
    if offload == "all":  # weights live on the host; groups are streamed one at a time
        host += weights
        weights = weights / max(groups, 1)
    return {
        "params_per_device": params,
        "weights": weights,
        "grads": grads,
        "optimizer": opt_bytes,
        "device_total": weights + grads + opt_bytes,
        "host": host,
    }


def offload_notes(plan) -> list[str]:
    """What --offload and --groups did to the plan's rows (issue 49 item 18): the row named
    "optimizer state" under --offload optimizer holds the fp32 master weights the device keeps
    (GroupedApply's masters of low-precision parameters), and under offload the step runs on
    the host group by group, so --groups leaves the device's rows as they are."""
    notes = []
    if plan.offload == "optimizer" and plan.optimizer_state:
        notes.append(
            f"  offload=optimizer: the 'optimizer state' row ({plan.optimizer_state / GiB:.2f} "
            "GiB) is the fp32 master weights, which stay on the device; the optimizer's moments "
            f"are in host memory ({plan.host_bytes / GiB:.2f} GiB with the host copies); "
            "--offload all moves the masters too"
        )
    if plan.offload and plan.groups > 1:
        notes.append(
            f"  groups={plan.groups} with offload: the step runs on the host one group at a "
            "time, so the device holds no step temporaries with or without groups; the groups "
            "bound the gradients and weights in flight between device and host"
        )
    elif plan.groups > 1:
        notes.append(
            f"  groups={plan.groups}: the step's temporaries are one group's, 1/{plan.groups} "
            "of a one-group step's"
        )
    return notes


def plan_report(
    cfg: M6Config,
    *,
    world_size: int,
    dp: int,
    ep: int,
    dtype: str = "fp16",
    offload: str | None = None,
    groups: int = 1,
    checkpointing: bool = True,
    micro_batch_tokens: int | None = None,
    device_memory_bytes: int | None = None,
    data_parallel: str = "ddp",
) -> str:
    """Counts from the meta-built model, the static memory floor, and moe.memory.estimate_memory's
    full plan when that function is available."""
    check_layout(cfg, world_size, dp, ep)
    with torch.device("meta"):
        model = cfg.build()
    total, experts = count_params(model)
    dense = total - experts
    gb = 1e9
    lines = [
        f"{cfg.name}: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, "
        f"d_ff {cfg.d_ff}, seq {cfg.seq_len} ({cfg.n_patches} patches + {cfg.text_len} text), "
        f"vocab {cfg.vocab_size}",
        f"  experts {cfg.num_experts} x top-{cfg.top_k} ({cfg.router}) in "
        f"{len(cfg.moe_block_names())} of {cfg.n_layers} blocks"
        if cfg.is_moe
        else "  dense FFNs",
        f"  parameters (meta-device numel): total {total:,} = {total / gb:.2f} B "
        f"(experts {experts:,}, dense {dense:,})",
        f"  active per token: {cfg.active_params:,} = {cfg.active_params / gb:.3f} B",
        f"  closed form (config.stated_params): {cfg.stated_params:,} "
        f"{'(matches)' if cfg.stated_params == total else '(MISMATCH)'}",
    ]
    if cfg.nominal_params:
        lines.append(f"  size the source states: {cfg.nominal_params / gb:g} B")
    lines.append(f"  source: {cfg.source}")
    lines.append(
        f"cluster: {world_size} devices as dp={dp} x ep={ep}; "
        f"{cfg.num_experts // ep if cfg.is_moe else 0} experts per device per MoE layer"
    )
    if hasattr(moe.memory, "estimate_memory"):
        result = moe.memory.estimate_memory(
            cfg,
            world_size=world_size,
            dp=dp,
            ep=ep,
            dtype=TORCH_DTYPES[dtype],
            offload=offload,
            groups=groups,
            checkpointing=checkpointing,
            micro_batch_tokens=micro_batch_tokens or cfg.seq_len,
            data_parallel=data_parallel,
            **({"device_memory_bytes": device_memory_bytes} if device_memory_bytes else {}),
        )
        lines.append(str(result))
        lines += offload_notes(result)
        return "\n".join(lines)
    mem = static_memory(dense, experts, ep, dtype, offload, groups)
    lines.append(
        f"static floor per device (moe.memory.estimate_memory unavailable: no activations): "
        f"weights {mem['weights'] / GiB:.1f} GiB + grads {mem['grads'] / GiB:.1f} GiB + "
        f"optimizer {mem['optimizer'] / GiB:.1f} GiB = {mem['device_total'] / GiB:.1f} GiB"
        + (f"; host {mem['host'] / GiB:.1f} GiB" if mem["host"] else "")
    )
    if device_memory_bytes:
        fits = mem["device_total"] <= device_memory_bytes
        verdict = "fits" if fits else "does NOT fit (try --offload optimizer)"
        lines.append(f"device memory {device_memory_bytes / GiB:.0f} GiB: {verdict}")
    return "\n".join(lines)
