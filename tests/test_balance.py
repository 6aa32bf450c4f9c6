"""Balance losses (sequence-wise, global-batch) against naive per-token references, balance
metrics, and the load accumulated over micro-batches for update_router_biases."""

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as outer_checkpoint
from torch.utils.checkpoint import set_checkpoint_early_stop

import moe
from moe.gating import sequence_balance_loss
from tests.distributed import run_ranks

D, F, E, K = 8, 12, 5, 2


def make_layer(seed=0, **options):
    torch.manual_seed(seed)
    options = dict(aux_loss_coef=0.3, z_loss_coef=0.0) | options
    return moe.MoELayer(D, F, E, top_k=K, **options)


def naive_batch(probs_TE, ids_TK):
    """E * sum_i f_i P_i by loops over tokens, float64."""
    T = probs_TE.shape[0]
    counts = [0] * E
    psum = torch.zeros(E, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            counts[int(ids_TK[t, k])] += 1
        psum = psum + probs_TE[t].double()
    return sum(E * counts[i] / (T * K) * psum[i] / T for i in range(E))


def naive_sequence(probs_TE, ids_TK, seq_len):
    T = probs_TE.shape[0]
    losses = [
        naive_batch(probs_TE[s : s + seq_len], ids_TK[s : s + seq_len])
        for s in range(0, T, seq_len)
    ]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_sequence_loss_matches_naive_loss_and_gradients(score_func):
    layer = make_layer(balance_loss="sequence", score_func=score_func)
    x_BSD = torch.randn(3, 7, D)
    layer(x_BSD)
    routing = layer.router(x_BSD.reshape(-1, D))
    expected = 0.3 * naive_sequence(routing.probs_TE, routing.expert_ids_TK, 7)
    torch.testing.assert_close(layer.aux_loss.double(), expected, rtol=1e-6, atol=1e-7)
    (grad,) = torch.autograd.grad(layer.aux_loss, layer.router.weight)
    (expected_grad,) = torch.autograd.grad(expected, layer.router.weight)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    # per sequence differs from the batch loss on the same tokens (so the mode matters)
    batch = 0.3 * naive_batch(routing.probs_TE, routing.expert_ids_TK)
    assert not torch.allclose(layer.aux_loss.double(), batch)
    layer(x_BSD[0])  # [S, d]: one sequence
    expected_one = 0.3 * naive_sequence(routing.probs_TE[:7], routing.expert_ids_TK[:7], 7)
    torch.testing.assert_close(layer.aux_loss.double(), expected_one.detach(), rtol=1e-6, atol=0)


def test_sequence_loss_function_float64_and_edge_cases():
    probs_TE = torch.rand(12, E, dtype=torch.float64).softmax(-1).requires_grad_()
    ids_TK = torch.randint(0, E, (12, K))
    got = sequence_balance_loss(probs_TE, ids_TK, 4)
    torch.testing.assert_close(got, naive_sequence(probs_TE, ids_TK, 4), rtol=1e-12, atol=0)
    assert sequence_balance_loss(probs_TE[:0], ids_TK[:0], 4) == 0
    with pytest.raises(ValueError, match="not whole sequences of 5"):
        sequence_balance_loss(probs_TE, ids_TK, 5)
    with pytest.raises(ValueError, match="balance_loss='sequence' needs router"):
        moe.MoEConfig(D, F, E, router="gshard", balance_loss="sequence")
    with pytest.raises(ValueError, match="balance_loss='seq' is not one of"):
        moe.MoEConfig(D, F, E, balance_loss="seq")


def naive_global(micro_batches):
    """Per micro-batch loss with counts over micro-batches 1..m; the step value."""
    losses, counts, tokens, psum = [], [0] * E, 0, torch.zeros(E, dtype=torch.float64)
    for probs_TE, ids_TK in micro_batches:
        for t in range(probs_TE.shape[0]):
            tokens += 1
            psum = psum + probs_TE[t].double().detach()
            for k in range(K):
                counts[int(ids_TK[t, k])] += 1
        mean_E = probs_TE.double().mean(0)
        losses.append(sum(E * counts[i] / (K * tokens) * mean_E[i] for i in range(E)))
    step = sum(E * counts[i] / (K * tokens) * psum[i] / tokens for i in range(E))
    return losses, step, counts


def test_global_loss_single_process_micro_batches():
    layer = make_layer(balance_loss="global")
    xs = [torch.randn(9, D), torch.randn(4, 3, D)]
    got = []
    for x in xs:
        layer(x)
        got.append(layer.aux_loss)
    routings = [layer.router(x.reshape(-1, D)) for x in xs]
    losses, step, counts = naive_global([(r.probs_TE, r.expert_ids_TK) for r in routings])
    for g, want in zip(got, losses):
        torch.testing.assert_close(g.double(), 0.3 * want.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.stats["global_balance_loss"], step, rtol=1e-6, atol=0)
    all_probs = torch.cat([r.probs_TE for r in routings])
    all_ids = torch.cat([r.expert_ids_TK for r in routings])
    torch.testing.assert_close(step, naive_batch(all_probs, all_ids), rtol=1e-12, atol=0)
    assert layer.global_balance.totals[:E].tolist() == counts
    moe.reset_global_balance(layer)
    layer(xs[0])  # a new step: micro-batch 1 alone
    torch.testing.assert_close(got[0], layer.aux_loss, rtol=1e-6, atol=0)
    layer.eval()  # eval: this batch only, step state untouched
    totals = layer.global_balance.totals.clone()
    layer(xs[1])
    want = naive_batch(routings[1].probs_TE, routings[1].expert_ids_TK)
    torch.testing.assert_close(layer.aux_loss.double(), 0.3 * want.detach(), rtol=1e-6, atol=0)
    assert torch.equal(layer.global_balance.totals, totals)


def _global_body(rank, world):
    torch.manual_seed(1)
    sizes = [[5, 3], [6, 0]]  # [micro-batch][rank] tokens: awkward, one rank empty
    xs = [[torch.randn(n, D) for n in mb] for mb in sizes]
    layer = make_layer(balance_loss="global")
    layer.router.load_group = dist.group.WORLD  # as moe.parallel.parallelize sets it
    means, grads = [], []
    for mb in xs:
        layer.zero_grad()
        layer(mb[rank])
        layer.aux_loss.backward()
        loss = layer.aux_loss.detach().clone()
        grad = layer.router.weight.grad.clone()
        dist.all_reduce(loss), dist.all_reduce(grad)  # data-parallel averaging
        means.append(loss / world)
        grads.append(grad / world)
    # single process, same weights: each micro-batch the concatenation of the ranks' parts
    ref = make_layer(balance_loss="global")
    ref_losses, ref_grads = [], []
    for mb in xs:
        ref.zero_grad()
        ref(torch.cat(mb))
        ref.aux_loss.backward()
        ref_losses.append(ref.aux_loss.detach())
        ref_grads.append(ref.router.weight.grad.clone())
    full = torch.cat([x for mb in xs for x in mb])
    routing = ref.router(full)
    counts = torch.bincount(routing.expert_ids_TK.reshape(-1), minlength=E).double()
    step_ref = naive_batch(routing.probs_TE, routing.expert_ids_TK).detach()
    return {
        "counts": torch.equal(layer.global_balance.totals[:E], counts),
        "tokens": float(layer.global_balance.totals[-1]),
        "losses": [(float(a), float(b)) for a, b in zip(means, ref_losses)],
        "grads": [float((a - b).abs().max()) for a, b in zip(grads, ref_grads)],
        "step": (float(layer.stats["global_balance_loss"]), float(step_ref)),
    }


def test_global_loss_two_ranks_equals_single_process_on_concatenation():
    results = run_ranks(_global_body, 2, timeout=60)
    for r in results:
        assert r["counts"] and r["tokens"] == 14
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=1e-6)
        assert max(r["grads"]) < 1e-7
        assert r["step"][0] == pytest.approx(r["step"][1], rel=1e-6)


def test_balance_metrics_in_stats():
    layer = make_layer()
    layer(torch.randn(4, 5, D))
    load = layer.stats["routed_per_expert"].double()
    mean = load.mean()
    cv = ((load - mean) ** 2).mean().sqrt() / mean
    torch.testing.assert_close(layer.stats["load_cv"].double(), cv, rtol=1e-6, atol=0)
    want = load.max() / mean
    torch.testing.assert_close(layer.stats["load_max_over_mean"].double(), want, rtol=1e-6, atol=0)
    assert int(layer.stats["dead_experts"]) == int((layer.stats["tokens_per_expert"] == 0).sum())
    layer(torch.randn(0, D))  # no tokens: zeros, not NaN
    assert layer.stats["load_cv"] == 0 and layer.stats["load_max_over_mean"] == 0


@pytest.mark.parametrize("checkpoint", [False, True])
def test_bias_update_uses_every_micro_batch_since_the_last_update(checkpoint):
    options = dict(score_func="sigmoid", bias_update_rate=0.05, recompute=checkpoint)
    micro, whole = make_layer(**options), make_layer(**options)
    for step in range(2):  # two steps: the count is reset by each update
        chunks = [torch.randn(n, 3, D, requires_grad=True) for n in (2, 1, 3, 2)]
        for x in chunks:  # checkpoint: the recomputed forward is not counted
            with set_checkpoint_early_stop(False):  # recompute runs to the layer's end
                y = outer_checkpoint(micro, x, use_reentrant=False) if checkpoint else micro(x)
            y.sum().backward()
        whole(torch.cat(chunks)).sum().backward()
        assert torch.equal(micro.load_since_update, whole.load_since_update)
        moe.update_router_biases(micro), moe.update_router_biases(whole)
        assert torch.equal(micro.router.expert_bias, whole.router.expert_bias)
        assert step == 1 or micro.router.expert_bias.abs().sum() > 0
    bias = micro.router.expert_bias.clone()
    moe.update_router_biases(micro)  # no forward since: nothing to update
    assert torch.equal(micro.router.expert_bias, bias)
    micro.eval()
    micro(torch.randn(2, D))  # eval forwards do not count
    assert micro.load_since_update is None
