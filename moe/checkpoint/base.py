"""The base model an adapters-only checkpoint (save_checkpoint(trainable_only=True)) was
trained on.

Such a checkpoint holds the trainable parameters alone (e.g. moe.lora's adapters); loaded onto
another base they would compute another function without a word. So the save records a
fingerprint of every frozen parameter and the load compares it (a difference is refused unless
allow_config_change). The fingerprint is cheap, a float64 sum of each row (along dim 0) of the
parameter, gathered: a few numbers per row, never the weights; and the same at any layout
(sharded or not, replicated experts' rows in canonical expert order), up to the order of the
float64 sums (compared to RTOL).
"""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe.checkpoint import replicas
from moe.shards import local

KEY = "base"
RTOL = 1e-9  # float64 sums of the same values in another order agree far closer than this


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """float64 sum of each row along dim 0 ([n]; a 0-d tensor: [1]), the whole tensor's: each
    rank sums its shard's rows (whole rows: shards split dim 0), then the [n] sums are
    gathered on the mesh's device (a CPU-offloaded shard's too)."""
    local_t = local(t).detach()
    dims = tuple(range(1, local_t.dim()))
    rows = local_t.sum(dim=dims, dtype=torch.float64) if dims else local_t.double()
    if isinstance(t, DTensor):
        kind = t.device_mesh.device_type
        device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else kind
        stride = (1,) if t.dim() else ()
        rows = DTensor.from_local(
            rows.to(device),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape[:1],
            stride=stride,
        ).full_tensor()
    return rows.reshape(-1)


def _number(x: torch.Tensor):
    value = float(x)
    return value if math.isfinite(value) else str(value)  # JSON holds no NaN / Inf


def fingerprint(model: nn.Module) -> dict[str, list]:
    """name -> [shape, sum, cosine-weighted sum, absolute sum] of the row sums of every frozen
    parameter (requires_grad False). Collective where parameters are DTensors: every rank
    holding them calls it."""
    layers = replicas.replica_layers(model)
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        rows = _row_sums(p)
        hit = replicas._expert_fqn(f"model/{name}", layers)
        if hit is not None and p.dim() > 0:  # spare slots: one row per expert, canonical order
            rows = rows.index_select(0, hit[0].slot_of_expert_E.to(rows.device))
        cos = torch.arange(rows.numel(), dtype=torch.float64, device=rows.device).cos()
        shape = [rows.numel(), *p.shape[1:]] if p.dim() else []
        sums = (rows.sum(), (rows * cos).sum(), rows.abs().sum())
        out[name] = [shape, *(_number(s) for s in sums)]
    return out


def _same(live: list, saved) -> bool:
    if not (isinstance(saved, list) and len(saved) == 4 and saved[0] == live[0]):
        return False
    if any(isinstance(v, str) or isinstance(s, str) for v, s in zip(live[1:], saved[1:])):
        return live[1:] == saved[1:]
    if not all(isinstance(s, int | float) for s in saved[1:]):
        return False
    scale = max(abs(live[3]), abs(saved[3]))
    return all(abs(v - s) <= RTOL * scale for v, s in zip(live[1:], saved[1:]))


def check(model: nn.Module, saved, problems: list, allow_change: bool) -> None:
    """The frozen parameters of `model` against the fingerprint `saved` with the checkpoint
    (None: saved before bases were recorded, nothing to compare). Collective, as fingerprint.
    Names this model (or this rank's part of it) lacks are not compared."""
    if saved is None:
        return
    if not isinstance(saved, dict):
        problems.append(f"objects.{KEY}: expected a JSON object")
        return
    live = fingerprint(model)
    differ = [n for n, record in live.items() if n in saved and not _same(record, saved[n])]
    if differ and not allow_change:
        problems.append(
            f"the adapters-only checkpoint was trained on another base model: {len(differ)} "
            f"frozen parameter(s) differ from the base it was saved with ({', '.join(differ[:3])}"
            f"{', ...' if len(differ) > 3 else ''}); load it onto that base, or pass "
            "allow_config_change=True"
        )
