"""The router losses' values and gradients, through the layer, against a per-token float64
reference (issue 49 item 19): for every router, the balance term (batch, and the sequence and
global terms where a router has them) plus the z-loss, differentiated with respect to the
router weight and the layer's input. A balance term whose scores were detached (a gradient
that only the z-loss carries) fails here; the forward values alone would not show it."""

import math

import pytest
import torch

import moe

D, F, E = 6, 8, 4
AUX, Z = 0.3, 0.05  # large enough that each term's share of the gradient shows


def _topk_ids(scores_E, k):
    return sorted(range(len(scores_E)), key=lambda e: -float(scores_E[e].detach()))[:k]


def _balance(probs, ids, E):
    """E * sum_e f_e P_e over tokens: f_e = pairs to e / pairs, P_e = mean score of e."""
    T = len(probs)
    pairs = sum(len(i) for i in ids)
    total = 0.0
    for e in range(E):
        f = sum(row.count(e) for row in ids) / pairs
        P = sum(probs[t][e] for t in range(T)) / T
        total = total + f * P
    return E * total


def _z(logits):
    return sum(torch.logsumexp(row, 0) ** 2 for row in logits) / len(logits)


def _cv2(v):
    mean = sum(v) / len(v)
    var = sum((a - mean) ** 2 for a in v) / (len(v) - 1)
    return var / (mean**2 + 1e-10)


def reference_aux(router, W, x, k, balance_loss="batch", seq_len=None, history=None):
    """The layer's aux_loss for tokens x [T, D] (float64, differentiable in W and x), one token
    at a time. history: the pair counts per expert and tokens of earlier micro-batches of the
    step ("global")."""
    logits = [W @ x[t] for t in range(x.shape[0])]
    if router == "sigmoid":
        s = [row.sigmoid() for row in logits]
        ids = [_topk_ids(row, k) for row in s]
        probs = [row / row.sum() for row in s]
    else:
        probs = [row.softmax(0) for row in logits]
        ids = [_topk_ids(row, k) for row in probs]
    if router == "gshard":
        balance = _balance(probs, [i[:1] for i in ids], E)  # top-1 assignments only
    elif router == "prototype":  # the mean over the k prototypes of each one's Switch loss
        X = E // k
        balance = 0.0
        for g in range(k):
            p = [row[g * X : (g + 1) * X].softmax(0) for row in logits]
            balance = balance + _balance(p, [_topk_ids(row, 1) for row in p], X)
        balance = balance / k
    elif router == "noisy_topk":  # eval: importance (differentiable) + load (counts)
        gates = []
        for row, i in zip(logits, ids):
            w = torch.stack([row[e] for e in i]).softmax(0)
            gates.append([w[i.index(e)] if e in i else row[0] * 0 for e in range(E)])
        importance = [sum(g[e] for g in gates) for e in range(E)]
        load = [float(sum(e in i for i in ids)) for e in range(E)]
        balance = _cv2(importance) + _cv2(torch.tensor(load, dtype=torch.float64))
    elif router == "expert_choice":
        balance = 0.0  # balanced by construction
    elif balance_loss == "sequence":
        S = seq_len
        seqs = range(0, len(probs), S)
        balance = sum(_balance(probs[a : a + S], ids[a : a + S], E) for a in seqs) / len(seqs)
    elif balance_loss == "global" and history is not None:  # counts of the step so far
        counts, tokens = history
        T = len(probs)
        for row in ids:
            for e in row:
                counts[e] += 1
        tokens += T
        balance = E * sum(counts[e] / (k * tokens) * sum(p[e] for p in probs) / T for e in range(E))
    else:
        balance = _balance(probs, ids, E)
    return AUX * balance + Z * _z(logits)


CASES = [
    ("topk", {}, "softmax"),
    ("topk", {"softmax_before_topk": False}, "softmax"),
    ("topk", {"score_func": "sigmoid", "normalize_weights": True}, "sigmoid"),
    ("topk", {"balance_loss": "sequence"}, "softmax"),
    ("topk", {"balance_loss": "global"}, "softmax"),
    ("switch", {"top_k": 1, "jitter_eps": 0.0}, "softmax"),
    ("switch", {"top_k": 1, "jitter_eps": 0.0, "balance_loss": "sequence"}, "softmax"),
    ("switch", {"top_k": 1, "jitter_eps": 0.0, "balance_loss": "global"}, "softmax"),
    ("gshard", {}, "gshard"),
    ("noisy_topk", {}, "noisy_topk"),
    ("prototype", {}, "prototype"),
    ("expert_choice", {"capacity_factor": 1.0}, "expert_choice"),
]


@pytest.mark.parametrize("router, options, kind", CASES, ids=lambda v: str(v))
def test_aux_loss_and_its_gradients_match_a_float64_reference(router, options, kind):
    torch.manual_seed(11)
    options = {"top_k": 2, **options, "aux_loss_coef": AUX, "z_loss_coef": Z}
    layer = moe.MoELayer(D, F, E, router=router, backend="torch", **options)
    if router == "noisy_topk":
        layer.eval()  # no noise: the reference's choice is the clean top-k
    k, balance_loss = layer.config.top_k, layer.config.balance_loss
    B, S = 3, 5  # 3 sequences of 5 tokens
    history = ([0] * E, 0)
    for step in range(2 if balance_loss == "global" else 1):  # "global": two micro-batches
        x = torch.randn(B, S, D, requires_grad=True)
        layer.zero_grad()
        layer(x)
        aux = layer.aux_loss
        assert aux.requires_grad, "the aux loss has no graph"
        aux.backward()
        W = layer.router.weight.detach().double().clone().requires_grad_()
        x64 = x.detach().double().reshape(B * S, D).clone().requires_grad_()
        counts, tokens = history
        expected = reference_aux(kind, W, x64, k, balance_loss, S, (counts, tokens))
        history = (counts, tokens + B * S)  # counts were updated in place
        expected.backward()
        scale = expected.detach().abs().item()
        assert math.isclose(aux.item(), expected.item(), rel_tol=1e-5), (step, aux, expected)
        for name, got, want in [
            ("router weight", layer.router.weight.grad, W.grad),
            ("input", x.grad.reshape(B * S, D), x64.grad),
        ]:
            assert want.abs().max() > 1e-3 * scale, f"{name}: the reference gradient is ~0"
            torch.testing.assert_close(
                got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item(), msg=name
            )
