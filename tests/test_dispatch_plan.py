"""The dispatch plan: capacity and sort-based permutation against the per-pair reference queue
(the dispatchers that move rows: test_dispatchers.py)."""

import math

import pytest
import torch

from moe.config import MoEConfig
from moe.dispatch import (
    capacity_factor_for,
    expert_capacity,
    gather_tokens,
    token_choice_rows,
    weighted_sum_rows,
)
from moe.gating import ROUTERS
from tests import reference as ref


def test_capacity_formula():
    assert expert_capacity(100, 8, 2, 1.25, 4) == math.ceil(1.25 * 2 * 100 / 8)
    assert expert_capacity(3, 64, 2, 1.0, 4) == 3  # floor of 4, but never more than T
    assert expert_capacity(10, 4, 1, 0.1, 2) == 2  # min_capacity floor
    assert expert_capacity(10, 4, 1, None) is None


@pytest.mark.parametrize("policy", ["position", "probs"])
@pytest.mark.parametrize("T,K,E,C", [(13, 2, 4, 5), (1, 1, 3, 1), (9, 3, 5, 2), (17, 2, 3, 4)])
def test_drops_match_reference_queue(policy, T, K, E, C):
    torch.manual_seed(T * 7 + K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K)
    plan = token_choice_rows(ids, weights, E, C, policy)
    keep = ref.keep_mask(ids.tolist(), weights, E, C, policy)
    keep = torch.tensor(keep)
    torch.testing.assert_close(plan.weights_TK, weights * keep)
    counts = torch.bincount(ids[keep], minlength=E)
    assert plan.counts_E.tolist() == counts.tolist()
    assert plan.num_dropped.item() == (~keep).sum().item()
    # Every kept pair's row lies in its expert's segment; dropped pairs sit at the tail.
    starts = [0] + plan.offsets_E.tolist()[:-1]
    for t in range(T):
        for j in range(K):
            row = plan.pair_rows_TK[t, j].item()
            assert plan.token_ids_M[row].item() == t
            e = ids[t, j].item()
            if keep[t, j]:
                assert starts[e] <= row < plan.offsets_E[e].item()
            else:
                assert row >= plan.offsets_E[-1].item()
    assert sorted(plan.pair_rows_TK.reshape(-1).tolist()) == list(range(T * K))


def test_dropless_and_all_tokens_to_one_expert():
    ids = torch.full((6, 1), 2)
    plan = token_choice_rows(ids, torch.ones(6, 1), 4, None)
    assert plan.counts_E.tolist() == [0, 0, 6, 0]
    assert plan.token_ids_M.tolist() == list(range(6))
    capped = token_choice_rows(ids, torch.ones(6, 1), 4, 4)
    assert capped.counts_E.tolist() == [0, 0, 4, 0] and capped.num_dropped.item() == 2
    assert capped.weights_TK[:, 0].tolist() == [1, 1, 1, 1, 0, 0]  # position: first 4 tokens


def test_gather_and_combine_gradients_match_dense_reference():
    torch.manual_seed(0)
    T, K, E, D = 7, 2, 3, 5
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    plan = token_choice_rows(ids, weights, E, 3)
    x_MD = gather_tokens(x, plan)
    out_MD = x_MD * torch.arange(1, x_MD.shape[0] + 1, dtype=torch.float64).unsqueeze(1)
    out_MD = torch.cat([out_MD[: plan.offsets_E[-1]], out_MD[plan.offsets_E[-1] :] * 0])
    y = weighted_sum_rows(out_MD, plan)
    g = torch.randn(T, D, dtype=torch.float64)
    (y * g).sum().backward()
    keep = plan.weights_TK.detach() != 0
    rows = plan.pair_rows_TK
    x2 = x.detach().clone().requires_grad_()
    w2 = weights.detach().clone().requires_grad_()
    y_ref = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            if keep[t, j]:
                y_ref[t] += w2[t, j] * x2[t] * (rows[t, j].item() + 1)
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(weights.grad * keep, w2.grad)


def test_eval_capacity_factor_chosen_once_for_token_and_expert_choice():
    config = MoEConfig(d_model=4, d_ff=4, num_experts=4, capacity_factor=1.0,
                       eval_capacity_factor=2.0)  # fmt: skip
    assert capacity_factor_for(config, training=True) == 1.0
    assert capacity_factor_for(config, training=False) == 2.0
    plain = MoEConfig(d_model=4, d_ff=4, num_experts=4, capacity_factor=1.0)
    assert capacity_factor_for(plain, training=False) == 1.0
    torch.manual_seed(0)
    router = ROUTERS["expert_choice"](
        MoEConfig(d_model=4, d_ff=4, num_experts=4, capacity_factor=1.0, eval_capacity_factor=2.0)
    )
    x_TD = torch.randn(16, 4)
    assert router(x_TD).token_ids_EC.shape == (4, 4)  # C = 1.0 * 16 / 4
    router.eval()
    assert router(x_TD).token_ids_EC.shape == (4, 8)  # C = 2.0 * 16 / 4
