"""Cross-rank configuration check: ranks that disagree on sizes would hang an all-to-all."""

from __future__ import annotations

import operator

import torch.distributed as dist


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


def describe_mismatch(per_rank: list[dict[str, int]]) -> str | None:
    """Message naming the first field whose value differs across ranks, or None if all agree.

    Fields are taken in rank 0's order, then any field only some ranks have. Pure function of
    the gathered values, so every rank builds the same message.
    """
    fields = list(per_rank[0])
    for values in per_rank[1:]:
        fields += [f for f in values if f not in fields]
    for field in fields:
        seen: dict[object, list[int]] = {}
        for rank, values in enumerate(per_rank):
            seen.setdefault(values.get(field, "missing"), []).append(rank)
        if len(seen) > 1:
            parts = [
                f"{_rank_list(ranks)} {'has' if len(ranks) == 1 else 'have'} {value}"
                for value, ranks in seen.items()
            ]
            return f"{field} differs across ranks: " + ", ".join(parts)
    return None


def check_same_across_ranks(values: dict[str, int], group: dist.ProcessGroup | None = None) -> None:
    """All-gather ``values`` over ``group``; raise the same ValueError on every rank if they differ.

    Call it once at setup with the sizes every rank must agree on (num_experts, top_k, d_model,
    ep size, ...). Example message: "num_experts differs across ranks: rank 0 has 8, rank 3 has 4".
    Works with any key sets (a key missing on some ranks is reported as "missing").
    """
    clean: dict[str, int] = {}
    for name, value in values.items():
        try:
            clean[str(name)] = operator.index(value)
        except TypeError:
            raise ValueError(
                f"{name} must be an int to compare across ranks, got {value!r}"
            ) from None
    gathered: list[dict[str, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, clean, group=group)
    message = describe_mismatch([g or {} for g in gathered])
    if message is not None:
        raise ValueError(message)
