"""Dispatchers in isolation: dispatch -> stand-in experts -> combine against a per-pair float64
loop (local), and expert-parallel on gloo ranks equal to local on the same tokens and plan.
The plan they consume (capacity, sort-based permutation) is tested in test_dispatch_plan.py."""

import pytest
import torch
import torch.distributed as dist

from moe.dispatch import (
    DISPATCHERS,
    DispatchContext,
    ExpertParallelDispatcher,
    LocalDispatcher,
    build_dispatcher,
    expert_choice_rows,
    register_dispatcher,
    token_choice_rows,
)
from tests.distributed import run_ranks

D = 5


def scale_experts(x_RD, offsets_L, ctx, first=0):
    """Stand-in experts: global expert e multiplies its rows by (e + 1); tail rows give 0.
    They honour the whole DispatchContext contract: gather on load, row weights, and the
    sum into tokens."""
    x_TD = x_RD
    if ctx.gather_ids_R is not None:
        x_RD = x_TD[ctx.gather_ids_R]
    rows_R = torch.arange(x_RD.shape[0], dtype=offsets_L.dtype)
    local_R = torch.searchsorted(offsets_L, rows_R, right=True)
    scale_R = torch.where(local_R < len(offsets_L), first + local_R + 1, 0).to(x_RD.dtype)
    if ctx.row_weights_R is not None:
        scale_R = scale_R * ctx.row_weights_R
    out_RD = x_RD * scale_R.unsqueeze(1)
    if ctx.sum_to_tokens:
        return torch.zeros_like(x_TD).index_add(0, ctx.gather_ids_R, out_RD)
    return out_RD


def token_choice_case(T, K, E, capacity, seed):
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.rand(T, E, generator=g).argsort(-1)[:, :K]  # K distinct experts per token
    weights_TK = torch.rand(T, K, generator=g, dtype=torch.float64).requires_grad_()
    x_TD = torch.randn(T, D, generator=g, dtype=torch.float64).requires_grad_()
    return x_TD, ids_TK, weights_TK, token_choice_rows(ids_TK, weights_TK, E, capacity)


def expert_choice_case(T, E, C, seed):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g, dtype=torch.float64).requires_grad_()
    scores_TE = torch.rand(T, E, generator=g, dtype=torch.float64)
    top_EC = scores_TE.t().topk(C, dim=-1)
    weights_EC = top_EC.values.clone().requires_grad_()
    return x_TD, top_EC.indices, weights_EC, expert_choice_rows(top_EC.indices, weights_EC, T)


def run(dispatcher, x_TD, plan, first=0):
    x_RD, offsets_L, ctx = dispatcher.dispatch(x_TD, plan)
    return dispatcher.combine(scale_experts(x_RD, offsets_L, ctx, first), ctx)


def grads(y_TD, *inputs):
    g_TD = torch.randn(y_TD.shape, generator=torch.Generator().manual_seed(7), dtype=y_TD.dtype)
    return torch.autograd.grad((y_TD * g_TD).sum(), inputs, retain_graph=True)  # plan shared


@pytest.mark.parametrize("fuse_combine", [True, False])
@pytest.mark.parametrize("T,K,E,capacity", [(9, 2, 4, 3), (7, 3, 5, None), (1, 1, 3, 1)])
def test_local_token_choice_matches_pair_loop(T, K, E, capacity, fuse_combine):
    x_TD, ids_TK, weights_TK, plan = token_choice_case(T, K, E, capacity, seed=T + K)
    y_TD = run(LocalDispatcher(fuse_combine), x_TD, plan)
    kept_TK = plan.weights_TK.detach() != 0
    y_ref = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            if kept_TK[t, j]:
                y_ref[t] = y_ref[t] + weights_TK[t, j] * x_TD[t] * (ids_TK[t, j] + 1)
    if capacity is not None and T > 1:
        assert not kept_TK.all()  # the case really drops pairs
    torch.testing.assert_close(y_TD, y_ref)
    for got, want in zip(grads(y_TD, x_TD, weights_TK), grads(y_ref, x_TD, weights_TK)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fuse_combine", [True, False])
def test_local_expert_choice_tokens_get_zero_to_all_experts(fuse_combine):
    T, E, C = 6, 4, 2
    x_TD, token_ids_EC, weights_EC, plan = expert_choice_case(T, E, C, seed=3)
    per_token_T = torch.bincount(token_ids_EC.reshape(-1), minlength=T)
    assert per_token_T.min() == 0 and per_token_T.max() > 1  # 0..E experts per token
    y_TD = run(LocalDispatcher(fuse_combine), x_TD, plan)
    y_ref = torch.zeros(T, D, dtype=torch.float64)
    for e in range(E):
        for c in range(C):
            t = token_ids_EC[e, c]
            y_ref[t] = y_ref[t] + weights_EC[e, c] * x_TD[t] * (e + 1)
    torch.testing.assert_close(y_TD, y_ref)
    for got, want in zip(grads(y_TD, x_TD, weights_EC), grads(y_ref, x_TD, weights_EC)):
        torch.testing.assert_close(got, want)


def test_local_triton_path_hands_over_tokens_and_gather_index():
    x_TD, _, _, plan = token_choice_case(8, 2, 4, 3, seed=1)
    x_RD, offsets_L, ctx = LocalDispatcher().dispatch(x_TD, plan)
    assert x_RD is x_TD and torch.equal(ctx.gather_ids_R, plan.token_ids_M)
    assert torch.equal(offsets_L, plan.offsets_E)


def test_registry_builds_by_name_and_names_the_choices():
    assert isinstance(build_dispatcher("local", fuse_combine=False), LocalDispatcher)
    assert DISPATCHERS["expert_parallel"] is ExpertParallelDispatcher
    with pytest.raises(ValueError, match=r"dispatcher='nope' is not one of \[.*'local'"):
        build_dispatcher("nope")
    with pytest.raises(ValueError, match="'local' is already registered"):
        register_dispatcher("local")(type("Other", (LocalDispatcher,), {}))


def _ep_body(rank, world):
    """Each case: this rank's tokens and plan through the EP dispatcher (L experts per rank)
    and through the local one; outputs and gradients must be equal."""
    E = 8
    L = E // world
    sizes = [5, 0, 9, 3]  # rank 1 has no tokens and still joins every collective
    problems = []
    cases = [
        ("token_capacity_flat", "flat", lambda: token_choice_case(sizes[rank], 2, E, 2, rank)),
        (
            "token_dropless_hier",
            "hierarchical",
            lambda: token_choice_case(sizes[rank], 3, E, None, rank),
        ),  # fmt: skip
        (
            "expert_choice_auto",
            "auto",
            lambda: expert_choice_case(sizes[rank], E, min(2, sizes[rank]), rank),
        ),  # fmt: skip
    ]
    for name, algorithm, make in cases:
        x_TD, _, weights, plan = make()
        ep = ExpertParallelDispatcher(dist.group.WORLD, L, algorithm, ranks_per_node=2)
        y_TD = run(ep, x_TD, plan, first=rank * L)
        y_ref = run(LocalDispatcher(), x_TD, plan)
        got, want = grads(y_TD, x_TD, weights), grads(y_ref, x_TD, weights)
        for label, a, b in [("y", y_TD, y_ref), ("dx", got[0], want[0]), ("dw", got[1], want[1])]:
            if not torch.allclose(a, b, rtol=1e-12, atol=1e-12):
                problems.append(f"rank {rank} {name}: {label} differs")
    try:  # a plan over the wrong number of experts: an error on every rank, no collective
        ExpertParallelDispatcher(dist.group.WORLD, L + 1).dispatch(x_TD, plan)
        problems.append(f"rank {rank}: no error for a plan with the wrong expert count")
    except ValueError as e:
        if f"num_local_experts={L + 1} x {world} ranks = {(L + 1) * world}" not in str(e):
            problems.append(f"rank {rank}: unclear error {e}")
    try:
        ExpertParallelDispatcher(dist.group.WORLD, L, algorithm="ring")
        problems.append(f"rank {rank}: no error for algorithm='ring'")
    except ValueError as e:
        if "algorithm must be one of" not in str(e):
            problems.append(f"rank {rank}: unclear error {e}")
    return problems


def test_expert_parallel_equals_local_on_gloo():
    results = run_ranks(_ep_body, 4, timeout=60)
    assert [p for rank_problems in results for p in rank_problems] == []


def _expert_choice_layer_body(rank, world):
    """Expert choice routes each rank's batch on its own; the parallelized layer must give
    what the single-device layer gives on the same shard (outputs and input gradients)."""
    import moe
    from moe.parallel import init_mesh, parallelize

    def build():
        torch.manual_seed(0)
        return moe.MoELayer(D, 7, 4, top_k=2, router="expert_choice", capacity_factor=1.5)

    reference = build()
    layer = parallelize(torch.nn.Sequential(build()), init_mesh(dp=1, ep=world))[0]
    assert layer.experts.num_experts == 4 // world
    x_TD = torch.randn(3 + 2 * rank, D, generator=torch.Generator().manual_seed(rank))
    outs = []
    for model in (layer, reference):
        x = x_TD.clone().requires_grad_()
        y = model(x)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), x.grad))
    return [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(outs[0], outs[1])]


def test_expert_choice_through_parallelize_equals_single_device_per_shard():
    results = run_ranks(_expert_choice_layer_body, 2, timeout=60)
    assert results == [[True, True]] * 2


def test_local_dispatcher_takes_only_fuse_combine():
    """The backend argument it never used said "removed in 0.1" and is gone (issue 39 item 6)."""
    with pytest.raises(TypeError):
        LocalDispatcher("torch", False)
    assert LocalDispatcher(False).fuse_combine is False
    with pytest.raises(TypeError):
        build_dispatcher("local", backend="triton")


def test_dispatch_context_holds_the_expert_rows():
    """ctx.rows is the ExpertRows the experts get; the old field names read it (issue 33)."""
    x_TD, _, _, plan = token_choice_case(8, 2, 4, 3, seed=2)
    _, _, ctx = LocalDispatcher(True).dispatch(x_TD, plan)
    assert ctx.expert_rows() is ctx.rows and ctx.sum_to_tokens and not ctx.all_rows_kept
    assert ctx.gather_ids_R is ctx.rows.gather_ids_R
    assert torch.equal(ctx.row_weights_R, plan.row_weights())
    with pytest.raises(TypeError, match="must be an ExpertRows"):
        DispatchContext(plan, plan.token_ids_M)


def _alone_body(rank, world):
    """dp = world, ep = 1: each rank's expert group is itself. Per dispatcher: collectives
    issued by one forward + backward of the parallelized layer (torch.distributed's, counted),
    and its output and input gradient against the same layer unparallelized (float32 rounding:
    the parallelized path sums in another order)."""
    import moe
    from moe.parallel import ParallelConfig, init_mesh, parallelize

    calls = []
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(dist.get_world_size(kwargs.get("group")))
        return real(*args, **kwargs)

    def build():
        torch.manual_seed(0)
        return moe.MoELayer(D, 7, 4, top_k=2)

    found = {}
    for config in (ParallelConfig(), ParallelConfig(overlap=2)):
        layer = parallelize(torch.nn.Sequential(build()), init_mesh(dp=world, ep=1), config=config)[
            0
        ]
        x_TD = torch.randn(6, D, generator=torch.Generator().manual_seed(rank))
        outs, issued = [], []
        for model in (layer, build()):
            x = x_TD.clone().requires_grad_()
            calls.clear()
            dist.all_to_all_single = counted
            try:
                y = model(x)
                (y * torch.arange(y.numel()).view_as(y)).sum().backward()
            finally:
                dist.all_to_all_single = real
            outs.append((y.detach(), x.grad))
            issued.append(calls[:])
        found[config.dispatcher_name] = (
            issued,
            [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(outs[0], outs[1])],
        )
    return found


def test_expert_group_of_one_rank_exchanges_nothing():
    """At ep = 1 the dispatch's count and row exchanges (5 a layer and micro-batch: counts,
    rows there and back, forward and backward) are copies, not gloo collectives on a group of
    one: each was a worker-thread hand-off, 0.1-1.2 ms on a loaded CPU (issue 62 item 10)."""
    results = run_ranks(_alone_body, 2, timeout=60)
    for found in results:
        assert found == {
            "expert_parallel": ([[], []], [True, True]),
            "overlap": ([[], []], [True, True]),
        }
