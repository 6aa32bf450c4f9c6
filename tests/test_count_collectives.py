"""One count collective per expert-parallel exchange, in every mode (issue 25, item 4).

The plain and the overlapped dispatcher plan from counts through moe.comm.exchange_expert_counts:
one collective of integers per forward (an all-to-all where every rank's own column is enough,
an all-gather of the count matrix where the 2D exchange or "auto" may need it), none in the
backward, whichever algorithm "auto" resolves to. Counted by wrapping torch.distributed's
collectives on 4 gloo ranks.
"""

import torch
import torch.distributed as dist

from moe.comm import ExchangeConfig
from moe.dispatch import ExpertParallelDispatcher, OverlappedDispatcher, token_choice_rows
from tests.distributed import run_ranks

COLLECTIVES = (
    "all_to_all_single",
    "all_to_all",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
)
D, E = 6, 8


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class Recorder:
    """Wraps torch.distributed's collectives; calls[i] = (name, integer payload?)."""

    def __init__(self):
        self.calls: list[tuple[str, bool]] = []
        self.saved = {}

    def __enter__(self):
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self.saved[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                ints = [not t.is_floating_point() for t in _tensors([*args, *kwargs.values()])]
                self.calls.append((_name, bool(ints) and all(ints)))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)

    def take(self) -> list[tuple[str, bool]]:
        calls, self.calls = self.calls, []
        return calls


ALGORITHMS_SEEN: list[str | None] = []  # ctx.algorithm of each expert call


def experts(x_RD, offsets_L, ctx):
    ALGORITHMS_SEEN.append(ctx.algorithm)
    return x_RD * 2.0


def _body(rank, world):
    L = E // world
    g = torch.Generator().manual_seed(rank)
    T = [5, 0, 9, 3][rank]
    ids_TK = torch.rand(T, E, generator=g).argsort(-1)[:, :2]
    weights_TK = torch.rand(T, 2, generator=g)
    x_TD = torch.randn(T, D, generator=g)
    # mode, ranks per node, "auto" threshold, the algorithm it must resolve to, the collective
    modes = [
        ("flat", 2, None, "flat", "all_to_all_single"),
        ("hierarchical", 2, None, "hierarchical", "all_gather"),
        ("hierarchical", 4, None, "flat", "all_to_all_single"),  # one node
        ("auto", 2, None, "flat", "all_gather"),  # gloo, no cost model: thresholds compared
        ("auto", 2, 1 << 20, "hierarchical", "all_gather"),
        ("auto", 2, 1, "flat", "all_gather"),  # may be 2D: decided on the gathered totals
        ("auto", 4, 1 << 20, "flat", "all_to_all_single"),  # one node
    ]
    seen = {}
    for algorithm, per_node, threshold, want, collective in modes:
        exchange = ExchangeConfig(hierarchical_max_bytes=threshold)
        group, args = dist.group.WORLD, (algorithm, per_node)
        for name, dispatcher in [
            ("plain", ExpertParallelDispatcher(group, L, *args, exchange_config=exchange)),
            ("overlap2", OverlappedDispatcher(group, L, *args, 2, exchange)),
        ]:
            key = f"{name}/{algorithm}/per_node={per_node}/threshold={threshold}"
            for call in range(2):  # the first call may create subgroups, detect topology
                x = x_TD.clone().requires_grad_()
                w = weights_TK.clone().requires_grad_()
                plan = token_choice_rows(ids_TK, w, E, None)
                ALGORITHMS_SEEN.clear()
                with Recorder() as rec:
                    y_TD, _ = dispatcher.run(x, plan, experts)
                    forward = rec.take()
                    y_TD.sum().backward()
                    backward = rec.take()
                if call == 1:
                    counts = [c for c, ints in forward if ints]
                    rows = [c for c, ints in forward + backward if not ints]
                    seen[key] = {
                        "count collectives": counts,
                        "in backward": [c for c, ints in backward if ints],
                        "algorithm": sorted(set(ALGORITHMS_SEEN)),
                        "row exchanges": len(rows) > 0,
                    }
                    expected = {
                        "count collectives": [collective],
                        "in backward": [],
                        "algorithm": [want],
                        "row exchanges": True,
                    }
                    if seen[key] != expected:
                        seen[key]["expected"] = expected
    return {k: v for k, v in seen.items() if "expected" in v}


def test_one_count_collective_per_forward_in_every_mode():
    results = run_ranks(_body, 4, timeout=60)
    problems = [f"rank {r}: {k}: {v}" for r, bad in enumerate(results) for k, v in bad.items()]
    assert not problems, "\n".join(problems)
