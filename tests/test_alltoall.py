"""Uneven all-to-all: flat == hierarchical == a single-process reference, bit for bit.

Every rank builds all ranks' inputs from a shared seed, so it can compute locally what it must
receive (forward) and what gradient must come back (backward). Rank bodies collect mismatch
descriptions instead of raising, so one wrong result cannot desynchronise the collectives.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from moe.comm.alltoall import (
    AllToAllSplits,
    choose_algorithm,
    default_hierarchical_threshold,
    exchange,
)
from moe.comm.exchange_config import ExchangeConfig
from moe.comm.expert_exchange import ExpertExchange, all_to_all, all_to_all_splits
from moe.comm.topology import Topology
from tests.distributed import run_ranks

CASES = ["random", "empty_rank", "all_elsewhere", "skewed", "all_zero"]


def make_case(case: str, seed: int, W: int, D: int, dtype: torch.dtype):
    """(counts_WW [src, dst], inputs per rank, output gradients per rank) for one scenario."""
    g = torch.Generator().manual_seed(seed)
    C = torch.randint(0, 6, (W, W), generator=g) * (torch.rand(W, W, generator=g) > 0.3)
    if case == "empty_rank":  # one rank has no tokens at all, another receives nothing
        C[seed % W, :] = 0
        C[:, (seed + 3) % W] = 0
    elif case == "all_elsewhere":  # one rank keeps nothing for itself; another sends to one peer
        k = seed % W
        C[k, :] = torch.randint(1, 4, (W,), generator=g)
        C[k, k] = 0
        C[(k + 1) % W, :] = 0
        C[(k + 1) % W, (k + 5) % W] = 7
    elif case == "skewed":  # everyone sends everything to rank 0
        C[:, 1:] = 0
    elif case == "all_zero":
        C.zero_()
    xs = [torch.randn(int(C[s].sum()), D, generator=g).to(dtype) for s in range(W)]
    gs = [torch.randn(int(C[:, d].sum()), D, generator=g).to(dtype) for d in range(W)]
    return C, xs, gs


def reference(C: torch.Tensor, xs: list, gs: list, rank: int):
    """Rows rank receives (grouped by source) and the gradient its input gets back."""
    W = C.shape[0]
    y = torch.cat([torch.split(xs[s], C[s].tolist())[rank] for s in range(W)])
    grad = torch.cat([torch.split(gs[d], C[:, d].tolist())[rank] for d in range(W)])
    return y, grad


def _check_exchange(label, x_src, counts, C, gs, rank, algorithm, L, group=None, chunks=None):
    """Run one forward+backward exchange and describe any mismatch with the reference.

    chunks=None goes through all_to_all; a number through all_to_all_splits + exchange with that
    pipeline depth."""
    xs_all, g_all = x_src
    y_ref, grad_ref = reference(C, xs_all, g_all, rank)
    x = xs_all[rank].clone().requires_grad_()
    if chunks is None:
        y, recv = all_to_all(x, counts, group=group, algorithm=algorithm, ranks_per_node=L)
    else:
        plan = all_to_all_splits(x, counts, group, algorithm, ranks_per_node=L, chunks=chunks)
        y, recv = exchange(x, plan), plan.recv_counts_W
    (y * g_all[rank]).sum().backward()
    problems = []
    if y.dtype != x.dtype or not torch.equal(y, y_ref):
        problems.append(
            f"{label}: forward differs (shape {tuple(y.shape)} vs {tuple(y_ref.shape)})"
        )
    if recv.dtype != torch.long or recv.tolist() != C[:, rank].tolist():
        problems.append(f"{label}: recv_counts {recv.tolist()} != {C[:, rank].tolist()}")
    if not torch.equal(x.grad, grad_ref):
        problems.append(f"{label}: backward differs")
    return problems


def _exchange_body(rank: int, world_size: int) -> list[str]:
    problems: list[str] = []
    configs = [
        ("flat", None, None),
        ("hierarchical", 4, None),  # 2 nodes x 4
        ("hierarchical", 2, None),  # 4 nodes x 2
        ("hierarchical", 8, None),  # one node: degenerates to flat
        ("hierarchical", 1, None),  # one rank per node: degenerates to flat
        ("auto", 4, None),  # flat on gloo by default
        ("hierarchical", 4, 3),  # pipelined over 3 chunks (some chunks of a block are empty)
        ("hierarchical", 2, 2),
    ]
    for i, case in enumerate(CASES):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        C, xs, gs = make_case(case, seed=10 + i, W=world_size, D=3 + i, dtype=dtype)
        for j, (algorithm, L, chunks) in enumerate(configs):
            counts = C[rank] if j % 2 == 0 else C[rank].tolist()
            label = f"{case}/{algorithm}/L={L}/chunks={chunks}"
            problems += _check_exchange(
                label, (xs, gs), counts, C, gs, rank, algorithm, L, chunks=chunks
            )
    problems += _plan_checks(rank, world_size)
    problems += _subgroup_checks(rank, world_size)
    return problems


def _plan_checks(rank: int, world_size: int) -> list[str]:
    """auto's choice, env override, and plan reuse: exchange then reverse is the identity."""
    problems = []
    C, xs, _ = make_case("random", seed=99, W=world_size, D=5, dtype=torch.float32)
    x = xs[rank]
    chosen = {
        "gloo default": all_to_all_splits(x, C[rank], algorithm="auto", ranks_per_node=4).algorithm
    }
    one_mib, zero = (ExchangeConfig(hierarchical_max_bytes=n) for n in (1 << 20, 0))
    for name, per_node, config in [("L=4", 4, one_mib), ("L=8", 8, one_mib),
                                   ("L=4,threshold=0", 4, zero)]:  # fmt: skip
        chosen[name] = all_to_all_splits(
            x, C[rank], algorithm="auto", ranks_per_node=per_node, exchange_config=config
        ).algorithm
    want = {
        "gloo default": "flat",
        "L=4": "hierarchical",
        "L=8": "flat",
        "L=4,threshold=0": "flat",
    }
    if chosen != want:
        problems.append(f"auto chose {chosen}, want {want}")
    os.environ["MOE_RANKS_PER_NODE"] = "2"
    try:
        plan = all_to_all_splits(x, C[rank], algorithm="hierarchical")
    finally:
        del os.environ["MOE_RANKS_PER_NODE"]
    if plan.topo is None or plan.topo.ranks_per_node != 2:
        problems.append(f"MOE_RANKS_PER_NODE=2 ignored: {plan.topo}")
    back = exchange(exchange(x, plan), plan.reverse())
    if not torch.equal(back, x):
        problems.append("hierarchical plan followed by its reverse is not the identity")
    return problems


def _subgroup_checks(rank: int, world_size: int) -> list[str]:
    """Two EP groups of 4 (as in EP x DP), each 2 nodes x 2, against a per-group reference."""
    half = world_size // 2
    groups = [dist.new_group(list(range(k * half, (k + 1) * half))) for k in range(2)]
    group = groups[rank // half]
    sub_rank = dist.get_rank(group)
    C, xs, gs = make_case("empty_rank", seed=50 + rank // half, W=half, D=4, dtype=torch.float32)
    problems = []
    for algorithm, L in [("flat", None), ("hierarchical", 2)]:
        label = f"subgroup{rank // half}/{algorithm}"
        problems += _check_exchange(
            label, (xs, gs), C[sub_rank], C, gs, sub_rank, algorithm, L, group
        )
    return problems


def test_flat_hierarchical_reference_8_ranks():
    """2x4, 4x2, degenerate layouts, auto and EP subgroups; forward and backward; 8 ranks."""
    results = run_ranks(_exchange_body, 8, timeout=60)
    problems = [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs]
    assert not problems, "\n".join(problems)


def _bad_input_body(rank: int, world_size: int) -> list[str]:
    """Only rank 0 makes bad calls: each must raise before communicating, or rank 1 would see
    the stray collective in the good exchange that follows."""
    messages = []
    if rank == 0:
        x = torch.zeros(3, 2)
        bad = [
            (torch.zeros(3), [3, 0], {}),
            (x, [3], {}),
            (x, [4, -1], {}),
            (x, [1, 1], {}),
            (x, torch.tensor([1.5, 1.5]), {}),
            (x, [3, 0], {"algorithm": "ring"}),
            (x, [3, 0], {"algorithm": "hierarchical", "ranks_per_node": 3}),
        ]
        for x_bad, counts, kwargs in bad:
            try:  # a call that communicated first would wait for rank 1: the collective's
                all_to_all(x_bad, counts, **kwargs)  # timeout (not a ValueError) fails the run
                messages.append("no error")
            except ValueError as e:
                messages.append(str(e))
    x = torch.full((2, 2), float(rank))
    y, _ = all_to_all(x, [1, 1])
    messages.append(y[:, 0].tolist())
    return messages


def test_bad_inputs_raise_before_communication():
    msgs, other = run_ranks(_bad_input_body, 2, timeout=20)
    expected = [
        "must be a 2D tensor",
        "has 1 entries but the group has 2 ranks",
        "negative entries",
        "sums to 2 but x_ND has 3 rows",
        "must be integer",
        "algorithm must be one of",
        "ranks_per_node=3 is larger than the group size 2",
    ]
    for fragment, msg in zip(expected, msgs):
        assert fragment in msg, (fragment, msg)
    assert msgs[len(expected) :] == [[0.0, 1.0]]
    assert other == [[0.0, 1.0]]


def _dead_peer_body(rank: int, world_size: int):
    """Rank 1 leaves without joining; rank 0's exchange must fail, not hang."""
    if rank == 1:
        return None
    try:
        all_to_all(torch.zeros(2, 2), [1, 1])
    except Exception as e:  # noqa: BLE001 - any backend error is the expected outcome
        return type(e).__name__
    return "no error"


def test_dead_peer_raises_instead_of_hanging():
    """A hang would end at run_ranks' deadline as "timed out" (an AssertionError here)."""
    outcome, _ = run_ranks(_dead_peer_body, 2, timeout=5)
    assert outcome != "no error"


def _raising_body(rank: int, world_size: int):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()  # never completes: rank 1 is gone
    return "unreachable"


def test_harness_reports_failure_without_hanging():
    """Rank 0 waits in a barrier with a 600 s collective timeout and an overall deadline past
    it: the harness must end it after the grace period that follows rank 1's failure (or see
    gloo notice the closed peer), not wait for the deadline ("timed out")."""
    with pytest.raises(AssertionError, match="boom on purpose") as info:
        run_ranks(_raising_body, 2, timeout=600, deadline=1200, grace=2)
    message = str(info.value)
    assert "rank 1 failed" in message and "timed out" not in message
    assert "--- rank 0 was killed after rank 1 failed" in message or "--- rank 0 failed" in message


def test_choose_algorithm_needs_more_than_one_node():
    def topo(L):
        return Topology(group_size=8, ranks_per_node=L, rank=0, source="argument")

    assert choose_algorithm(topo(8), 1, threshold=1 << 20) == "flat"
    assert choose_algorithm(topo(1), 1, threshold=1 << 20) == "flat"
    assert choose_algorithm(topo(4), 1 << 20, threshold=1 << 20) == "hierarchical"
    assert choose_algorithm(topo(4), (1 << 20) + 1, threshold=1 << 20) == "flat"
    assert choose_algorithm(topo(4), 1 << 20, backend="gloo") == "flat"
    two_nodes = Topology(group_size=16, ranks_per_node=8, rank=0, source="argument")
    assert choose_algorithm(two_nodes, 1 << 20, backend="nccl") == "hierarchical"
    big = Topology(group_size=480, ranks_per_node=8, rank=0, source="argument")
    assert default_hierarchical_threshold(big, "nccl") > 64 << 20
    assert 4 << 20 < default_hierarchical_threshold(two_nodes, "nccl") < 64 << 20
    assert choose_algorithm(topo(4), 1, backend="nccl") == "flat"  # 2x4: 3 messages saved


def test_plan_reverse_swaps_counts():
    C = ((1, 2), (3, 4))
    plan = AllToAllSplits("hierarchical", None, (1, 2), (1, 3), torch.tensor([1, 3]), C, None)
    rev = plan.reverse()
    assert (rev.send, rev.recv, rev.counts_WW) == ((1, 3), (1, 2), ((1, 3), (2, 4)))
    assert rev.recv_counts_W.tolist() == [1, 2]


def test_expert_exchange_splits_chunks_of_local_experts():
    """ExpertExchange.splits(first, last): the split sizes of local experts [first, last), and a
    reverse that takes its send counts from the device tensors (no host-to-device copy)."""
    send_WL, recv_WL = ((1, 2, 3), (4, 5, 6)), ((0, 1, 0), (2, 0, 7))
    counts = ExpertExchange(
        "flat",
        None,
        8,
        send_WL,
        recv_WL,
        torch.tensor(recv_WL),
        torch.tensor(send_WL),
        extras_W=((), ()),
        totals_W=(6, 15),
    )
    assert counts.max_rank_bytes == 15 * 8
    whole, tail = counts.splits(), counts.splits(1, 3)
    assert (whole.send, whole.recv) == ((6, 15), (1, 9))
    assert (tail.send, tail.recv, tail.recv_counts_W.tolist()) == ((5, 11), (1, 7), [1, 7])
    back = tail.reverse()
    assert (back.send, back.recv) == ((1, 7), (5, 11))
    assert back.recv_counts_W is tail.send_counts_W and back.send_counts_W is tail.recv_counts_W
