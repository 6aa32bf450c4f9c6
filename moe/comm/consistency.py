"""Cross-rank agreement: ranks that disagree on sizes would hang an all-to-all, and a rank
that fails alone would leave the others waiting in the next collective.

check_same_across_ranks: the same values on every rank, or the same ValueError naming the
field. raise_if_any_rank_failed / same_error_on_every_rank: an exception (or problem message)
on any rank becomes the same named error (CrossRankError by default) on every rank, at once.

Each rank's record is JSON (no pickle: what another rank sends is data, never code), padded
to the longest record and all-gathered as bytes.
"""

from __future__ import annotations

import contextlib
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


class CrossRankError(ValueError):
    """A step every rank takes together failed on one or more ranks: raised on every rank of
    the group with the same text, naming each failing rank and why."""


Problem = BaseException | str | list[str] | None


def _lines(problem: Problem) -> list[str]:
    """One rank's problem as message lines; an exception other than a ValueError keeps its
    type's name (a RuntimeError from a user callback is not a bad value)."""
    if problem is None:
        return []
    if isinstance(problem, str):
        return [problem]
    if isinstance(problem, BaseException):
        text = str(problem) or "(no message)"
        return [text if isinstance(problem, ValueError) else f"{type(problem).__name__}: {text}"]
    return [str(p) for p in problem]


def raise_if_any_rank_failed(
    problem: Problem,
    group: dist.ProcessGroup | None = None,
    *,
    error: type[Exception] = CrossRankError,
    what: str = "",
    max_lines: int = 20,
    values: dict[str, Scalar] | None = None,
) -> None:
    """Every rank passes its own problem (None, a message, a list of messages or the exception
    it caught); if any rank has one, every rank raises the same `error` naming each failing
    rank and its messages (identical ones merged: "ranks 0-3: ..."). The local exception, if
    any, is the raised error's cause. With `values` (JSON scalars every rank must agree on,
    e.g. {"min_gain": 0.1}), ranks that differ raise the same `error` naming the field and
    ranks (check_same_across_ranks' message), in the same exchange. One exchange of JSON
    records (no pickle), so every rank of `group` must call it at the same point, and nothing
    between the failure and this call may communicate. Without torch.distributed (or with one
    rank) it raises the same text without rank names.

    Example: raise_if_any_rank_failed(e, error=CheckpointError, what="load_checkpoint") ->
    "load_checkpoint: rank 1: RuntimeError: boom" on every rank.
    """
    lines = _lines(problem)
    values = dict(values or {}) if values is not None else None
    for name, value in list((values or {}).items()):  # refused here, not before the exchange
        if value is not None and not isinstance(value, int | float | str | bool):
            lines.append(f"{name} must be an int, float, str, bool or None, got {value!r:.80}")
            values[name] = repr(value)[:80]
    head = f"{what}: " if what else ""
    cause = problem if isinstance(problem, BaseException) else None
    mismatch = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        record: dict[str, Scalar] = {f"problem {i}": m for i, m in enumerate(lines)}
        record |= {f"value {k}": v for k, v in (values or {}).items()}
        everyone = all_gather_records(record, group)
        by_text: dict[str, list[int]] = {}
        for rank, got in enumerate(everyone):
            for key, text in got.items():
                ranks = by_text.setdefault(str(text), []) if key.startswith("problem ") else None
                if ranks is not None and rank not in ranks:
                    ranks.append(rank)
        lines = [f"{_rank_list(ranks)}: {text}" for text, ranks in by_text.items()]
        if values is not None:
            mismatch = describe_mismatch(
                [{k[6:]: v for k, v in got.items() if k.startswith("value ")} for got in everyone]
            )
    if lines:
        if len(lines) == 1:
            message = head + lines[0]
        else:
            more = f"\n  ... and {len(lines) - max_lines} more" if len(lines) > max_lines else ""
            message = head.rstrip() + "\n  " + "\n  ".join(lines[:max_lines]) + more
        raise error(message) from cause
    if mismatch is not None:
        raise error(head + mismatch)


@contextlib.contextmanager
def same_error_on_every_rank(
    group: dist.ProcessGroup | None = None,
    *,
    error: type[Exception] = CrossRankError,
    what: str = "",
    values: dict[str, Scalar] | None = None,
):
    """Run the block on every rank; an Exception it raises on any rank becomes the same
    `error` on every rank (raise_if_any_rank_failed), also on the ranks where it succeeded;
    `values` that differ across ranks too (checked in the same exchange).
    The block must not communicate (a rank that fails before a collective would leave the
    others in it). Example:

        with same_error_on_every_rank(what="rebalance_experts"):
            validate_arguments(...)   # local checks only
    """
    problem: Exception | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        problem = e
    raise_if_any_rank_failed(problem, group, error=error, what=what, values=values)
