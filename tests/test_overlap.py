"""Overlapped expert-parallel dispatch: outputs and every gradient equal the plain dispatcher's
(flat and hierarchical, ddp and fsdp, uneven splits, a rank with zero tokens, experts with zero
rows, dropped rows, shared experts), the pipeline order of forward and backward, the degree
choice of overlap="auto", and clear errors instead of hangs."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

import moe
from moe.comm.cost_model import CostModel
from moe.dispatch import (
    OverlappedDispatcher,
    choose_degree,
    overlap_clock,
    overlapped,
    validate_overlap,
)
from moe.dispatch.overlap_clock import ForwardTimes
from moe.dispatch.overlap_degree import pipelined_time
from moe.parallel import init_mesh, parallelize
from tests.distributed import run_ranks

D, F = 16, 24
SLOW_LINK = CostModel(1e-3, 1e-4, 1e9, 1e-4, 1e7, 1e9, 1e-3)  # 10 MB/s network


def build(seed, num_experts, **options):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D, D),
        moe.MoELayer(D, F, num_experts, top_k=2, aux_loss_coef=0.0, **options),
    )


def step(model, x_TD, g_TD):
    """Output, input gradient and every parameter gradient (full tensors) of one backward."""
    x = x_TD.clone().requires_grad_()
    y = model(x)
    (y * g_TD).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return y.detach(), x.grad, grads


# name, dp, ep, tokens per rank, overlap, num_experts, MoELayer options, parallelize options
CASES = [
    ("flat_ep4_zero_tokens", 1, 4, [5, 0, 9, 3], 2, 12, {}, {"algorithm": "flat"}),
    (
        "hier_ep4_drops",
        1,
        4,
        [7, 4, 0, 6],
        2,
        8,
        {"capacity_factor": 0.5, "min_capacity": 1},
        {"algorithm": "hierarchical", "ranks_per_node": 2},
    ),
    (
        "ddp_dp2_ep2_shared_checkpointed",
        2,
        2,
        [6, 2, 5, 8],
        3,
        12,
        {"num_shared_experts": 1, "recompute": True},
        {},
    ),
    (
        "fsdp_dp2_ep2_empty_experts",
        2,
        2,
        [2, 1, 3, 2],
        4,
        16,
        {},
        {"data_parallel": "fsdp", "algorithm": "flat"},
    ),
    ("auto_degree", 1, 4, [5, 6, 4, 7], "auto", 8, {}, {}),
    # a token's rows are added in row order: the pipeline's chunk order must not change it
    ("expert_choice", 1, 4, [8, 6, 0, 7], 4, 16, {"router": "expert_choice"}, {}),
]


@contextlib.contextmanager
def _counting_fsdp_all_gathers():
    """Count FSDP2's parameter all-gathers (one per unshard of a unit) while inside."""
    count = [0]
    original = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    try:
        yield count
    finally:
        _fsdp_param_group.foreach_all_gather = original


def _equal_body(rank, world, cases):
    problems = []
    for name, dp, ep, sizes, overlap, E, options, popts in cases:
        g = torch.Generator().manual_seed(100 + rank)
        x_TD, g_TD = torch.randn(2, sizes[rank], D, generator=g)
        results, layers, degrees, gathers = [], [], [], []
        # auto: the cost model (tested below) says "pipeline"; the measurements must agree
        overlapped.choose_degree = lambda *args, **kw: args[5]  # max_degree
        for ov in (None, overlap):
            model = parallelize(
                build(0, E, **options), init_mesh(dp=dp, ep=ep), **popts, overlap=ov
            )
            results.append([])
            with _counting_fsdp_all_gathers() as count:
                for _ in range(4):  # auto: n = 1 (no expert time yet), then it explores: n, 1, n
                    results[-1].append(step(model, x_TD, g_TD))
                    degrees.append(getattr(model[1].dispatcher, "last_degree", 0))
            gathers.append(count[0])
            layers.append(model[1])
        overlapped.choose_degree = choose_degree
        if gathers[0] != gathers[1]:  # the experts are gathered once per layer call, not per chunk
            problems.append(
                f"{name}: FSDP2 all-gathers plain {gathers[0]}, overlapped {gathers[1]}"
            )
        if overlap == "auto":
            everyone = [None] * world
            dist.all_gather_object(everyone, degrees)
            if any(d != degrees for d in everyone) or degrees[4:8] != [1, E // ep, 1, E // ep]:
                problems.append(f"{name}: auto degrees {everyone}")
        plain, over = results
        if not isinstance(layers[1].dispatcher, OverlappedDispatcher):
            problems.append(f"{name}: overlap={overlap} did not install the overlapped dispatcher")
        for (y0, dx0, g0), (y1, dx1, g1) in zip(plain, over):
            for label, a, b in [("y", y0, y1), ("dx", dx0, dx1)] + [
                (n, g0[n], g1.get(n)) for n in g0
            ]:
                if b is None or not torch.equal(a, b):
                    problems.append(f"rank {rank} {name}: {label} differs")
        if overlap != "auto" and layers[1].dispatcher.last_degree != min(overlap, E // ep):
            problems.append(f"{name}: degree {layers[1].dispatcher.last_degree}")
        stats = layers[1].stats
        if "empty" in name and int(stats["dead_experts"]) == 0:
            problems.append(f"{name}: no expert without rows")
        dropped = stats["dropped"].clone()
        dist.all_reduce(dropped)  # some rank drops rows
        if "drops" in name and int(dropped) == 0:
            problems.append(f"{name}: nothing dropped")
    try:  # ranks asking for different degrees: the same error everywhere, no hang
        parallelize(build(0, 8), init_mesh(dp=1, ep=world), overlap=2 if rank == 3 else 4)
        problems.append(f"rank {rank}: no error for mismatched overlap")
    except ValueError as e:
        if "overlap differs across ranks" not in str(e) or "rank 3 has 2" not in str(e):
            problems.append(f"rank {rank}: unclear error {e}")
    try:
        parallelize(build(0, 8), init_mesh(dp=1, ep=world), overlap=0)
        problems.append(f"rank {rank}: no error for overlap=0")
    except ValueError as e:
        if "overlap must be None, an int >= 1 or 'auto', got 0" not in str(e):
            problems.append(f"rank {rank}: unclear error {e}")
    return problems


def test_overlapped_equals_plain_dispatcher_on_gloo():
    results = run_ranks(_equal_body, 4, CASES, timeout=120)
    problems = [p for problems in results for p in problems]
    assert problems == [], "\n".join(problems)


def _chunk_calls(layer, events, fail_on_rank=None):
    """Record each chunk's expert call (X) and the experts module's one call (M); rank
    `fail_on_rank` raises in its first chunk instead."""
    mlp = layer.experts.mlp

    def traced(*args, **kwargs):
        if dist.get_rank() == fail_on_rank:
            raise RuntimeError(f"rank {fail_on_rank} fails in its experts")
        events.append("X")
        return mlp(*args, **kwargs)

    layer.experts.mlp = traced
    layer.experts.register_forward_hook(lambda *_: events.append("M"))


def _trace_body(rank, world):
    """The order in which exchanges start (S) and land (L), with expert calls (X), for a
    two-chunk layer: forward and backward must interleave exchange and compute."""
    events = []
    start = overlapped.start_exchange

    def traced(x_ND, plan, worker):
        events.append(f"S{x_ND.shape[0]}")
        land = start(x_ND, plan, worker)

        def traced_land():
            events.append("L")
            return land()

        return traced_land

    overlapped.start_exchange = traced
    traces = {}
    for algorithm in ("flat", "hierarchical"):
        model = parallelize(
            build(0, 8, num_shared_experts=1),
            init_mesh(dp=1, ep=world),
            algorithm=algorithm,
            ranks_per_node=2,
            overlap=2,
        )
        layer = model[1]
        _chunk_calls(layer, events)
        layer.shared_experts.register_forward_hook(lambda *_: events.append("H"))
        layer.shared_experts.register_full_backward_hook(lambda *_: events.append("h"))
        x = torch.randn(6, D, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        events.clear()
        y = model(x)
        events.append("|")
        y.square().sum().backward(retain_graph=True)
        traces[algorithm] = "".join(e[0] for e in events)
        # a retained graph runs backward again: the same gradients once more
        grads = [p.grad.full_tensor().clone() for p in model.parameters()]
        y.square().sum().backward()
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad.full_tensor(), 2 * g, rtol=1e-6, atol=1e-7)
    overlapped.start_exchange = start
    # check_finite reads each chunk's rows: local expert 1 (chunk 1) holds a NaN on every rank
    model = parallelize(build(0, 8, check_finite=True), init_mesh(dp=1, ep=world), overlap=2)
    with torch.no_grad():
        model[1].experts.w2.to_local()[1, 0, 0] = float("nan")
    try:
        model(torch.randn(6, D))
        return traces, "no error"
    except FloatingPointError as e:
        return traces, str(e)


def test_pipeline_order_forward_and_backward():
    results = run_ranks(_trace_body, 4, timeout=60)
    for rank, (_, message) in enumerate(results):
        assert message.endswith(
            f"NaN or Inf in the weights or outputs of expert(s) [{2 * rank + 1}] "
            f"(slots [{2 * rank + 1}])"
        )
    traces = [t for t, _ in results]
    # forward: both dispatches start, the shared experts run (H), land chunk 0, experts 0 (X),
    # start its combine, land chunk 1 (it travelled during experts 0), experts 1, start
    # combine 1, land both combines; the experts module was called once (M). backward: both
    # combine gradients start; then per chunk in that order: land, (expert backward,) start its
    # dispatch gradient, which travels during the other chunk's expert backward and, for the
    # last, the shared backward (h).
    expected = "SSHLXSLXSLLM|SSLSLShLL"
    assert traces == [{"flat": expected, "hierarchical": expected}] * 4


def _failing_body(rank, world, algorithm):
    """Rank 2 fails inside its first chunk's experts, with exchanges in flight."""
    model = parallelize(
        build(0, 8), init_mesh(dp=1, ep=world), algorithm=algorithm, ranks_per_node=2, overlap=2
    )
    _chunk_calls(model[1], [], fail_on_rank=2)
    model(torch.randn(4, D, requires_grad=True)).sum().backward()
    return "finished"


@pytest.mark.parametrize("algorithm", ["flat", "hierarchical"])
def test_a_failing_rank_is_an_error_on_every_rank(algorithm):
    """The other ranks' pending exchanges time out with an error (no rank hangs: each one
    reports a failure of its own within the grace period, none has to be killed)."""
    with pytest.raises(AssertionError) as info:
        run_ranks(_failing_body, 4, algorithm, timeout=10, deadline=240, grace=60)
    message = str(info.value)
    assert "rank 2 fails in its experts" in message
    assert all(f"--- rank {r} failed" in message for r in range(4)), message
    assert "killed" not in message


def test_validate_overlap():
    assert validate_overlap(None) is None and validate_overlap("auto") == "auto"
    assert validate_overlap(3) == 3
    for bad in (0, -1, 1.5, True, "fast"):
        with pytest.raises(ValueError, match="overlap must be None, an int >= 1 or 'auto'"):
            validate_overlap(bad)


def test_auto_degree_pipelines_only_where_it_pays():
    # 2 MB per rank over 2 nodes x 2: the exchange ~0.1 s, about the expert time
    n = choose_degree(SLOW_LINK, 2 << 20, 2, 2, expert_seconds=0.1, max_degree=4)
    assert n > 1
    assert choose_degree(None, 2 << 20, 2, 2, 0.1, 4) == 1  # no cost model
    assert choose_degree(SLOW_LINK, 2 << 20, 2, 2, 0.0, 4) == 1  # no measurement yet
    assert choose_degree(SLOW_LINK, 2 << 20, 2, 2, 0.1, 1) == 1  # one local expert
    assert choose_degree(SLOW_LINK, 64, 2, 2, 1e-5, 4) == 1  # tiny: fixed costs dominate
    assert pipelined_time(2.0, 3.0, 1) == 7.0  # n = 1 is plain: 2x + e
    assert pipelined_time(1.0, 1.0, 2) == 5.0


def test_forward_times_keep_the_fastest_recent_warm_calls(monkeypatch):
    """auto's measurements: each option's first (cold) call is dropped, the fastest of the last
    RECENT kept calls counts, and the options alternate until each has EXPLORE kept times. The
    host clock is a fixed one here (NOW), so a call of `s` seconds measures exactly `s`."""
    NOW = 1000.0
    monkeypatch.setattr(overlap_clock, "time", SimpleNamespace(perf_counter=lambda: NOW))
    times = ForwardTimes()
    order = []
    for piped, seconds in [(False, 9.0), (True, 8.0), (False, 2.0), (True, 3.0), (False, 4.0)]:
        order.append(times.next_to_explore())
        times.stop(NOW - seconds, piped)
    assert order == [False, True, False, True, False]  # the one run less often goes next
    assert times.fastest(False) == 2.0  # 9 s was the cold call
    assert times.fastest(True) == 3.0
    assert times.exploring()
    for seconds in [5.0, 6.0, 7.0, 8.0]:  # the 2 s call leaves the window of RECENT = 4
        times.stop(NOW - seconds, False)
    assert times.fastest(False) == 5.0
    for _ in range(2):
        times.stop(NOW - 1.0, True)
    assert not times.exploring() and times.fastest(True) == 1.0


def test_default_run_is_dispatch_experts_combine():
    """The seam's default `run` (used by every other dispatcher) gives the layer's output."""
    torch.manual_seed(0)
    layer = moe.MoELayer(D, F, 4, top_k=2, num_shared_experts=1)
    x = torch.randn(7, D)
    calls = []
    experts = layer.experts
    layer.experts.register_forward_hook(lambda *_: calls.append("experts"))
    y = layer(x)
    plan = layer._row_map(layer._route(x), 7)
    y_TD, shared = layer.dispatcher.run(
        x,
        plan,
        lambda x_RD, o, ctx: experts(x_RD, o, rows=ctx.expert_rows()),
        lambda: layer.shared_experts(x),
    )
    torch.testing.assert_close(y, y_TD + shared, rtol=0, atol=0)
    assert calls == ["experts", "experts"]
