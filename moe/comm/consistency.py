"""Cross-rank configuration check: ranks that disagree on sizes would hang an all-to-all.

Each rank's record is JSON (no pickle: what another rank sends is data, never code), padded
to the longest record and all-gathered as bytes.
"""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

Scalar = int | float | str | bool | None


def _rank_list(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0-2, 5'."""
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def describe_mismatch(per_rank: list[dict[str, Scalar]]) -> str | None:
    """Message naming the first field whose value differs across ranks, or None if all agree.

    Fields are taken in rank 0's order, then any field only some ranks have. Pure function of
    the gathered values, so every rank builds the same message.
    """
    fields = list(per_rank[0])
    for values in per_rank[1:]:
        fields += [f for f in values if f not in fields]
    for field in fields:
        seen: dict[str, list[int]] = {}
        for rank, values in enumerate(per_rank):
            value = values.get(field, "missing")
            seen.setdefault(value if isinstance(value, str) else json.dumps(value), []).append(rank)
        if len(seen) > 1:
            parts = [
                f"{_rank_list(ranks)} {'has' if len(ranks) == 1 else 'have'} {value}"
                for value, ranks in seen.items()
            ]
            return f"{field} differs across ranks: " + ", ".join(parts)
    return None


def _encode(values: dict[str, Scalar]) -> bytes:
    clean: dict[str, Scalar] = {}
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = repr(value)  # JSON has no NaN/inf; compare their spelling
        if value is not None and not isinstance(value, (int, float, str, bool)):
            raise ValueError(
                f"{name} must be an int, float, str, bool or None to compare across ranks, "
                f"got {value!r}"
            )
        clean[str(name)] = value
    return json.dumps(clean).encode()


def _decode(data: bytes, rank: int) -> dict[str, Scalar]:
    try:
        values = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"rank {rank} sent an unreadable configuration record: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"rank {rank} sent a configuration record that is not a JSON object")
    return values


def all_gather_records(
    values: dict[str, Scalar], group: dist.ProcessGroup | None = None
) -> list[dict[str, Scalar]]:
    """Every rank's `values` (JSON scalars), in rank order of `group`: two collectives."""
    data = torch.frombuffer(bytearray(_encode(values)), dtype=torch.uint8)
    world = dist.get_world_size(group)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    length = torch.tensor([data.numel()], dtype=torch.long, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t) for t in lengths]  # setup-time host read, not on a training path
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [
        _decode(bytes(t[:n].cpu().numpy()), rank)
        for rank, (t, n) in enumerate(zip(gathered, sizes))
    ]


def check_same_across_ranks(
    values: dict[str, Scalar], group: dist.ProcessGroup | None = None
) -> None:
    """All-gather ``values`` over ``group``; raise the same ValueError on every rank if they differ.

    Call it once at setup with what every rank must agree on (num_experts, top_k, d_model,
    ep size, dtypes, ...). Example message: "num_experts differs across ranks: rank 0 has 8,
    rank 3 has 4". Works with any key sets (a key missing on some ranks is "missing").
    """
    message = describe_mismatch(all_gather_records(values, group))
    if message is not None:
        raise ValueError(message)
