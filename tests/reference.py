"""Naive float64 references: per-token loops, written for clarity, never for speed."""

import math

import torch
import torch.nn.functional as F

ACT = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def expert_ffn(x_D, e, w1, w2, w3=None, b1=None, b2=None, activation="gelu"):
    """One expert's MLP on one token, float64."""
    h = x_D @ w1[e].double()
    if b1 is not None:
        h = h + b1[e].double()
    if activation == "swiglu":
        h = F.silu(h) * (x_D @ w3[e].double())
    else:
        h = ACT[activation](h)
    y = h @ w2[e].double()
    if b2 is not None:
        y = y + b2[e].double()
    return y


def topk_route(
    logits_E,
    k,
    score_func="softmax",
    softmax_before_topk=True,
    normalize=False,
    scale=1.0,
    bias_E=None,
    num_groups=1,
    topk_groups=1,
):
    """One token's (expert ids, weights) under the top-k router, float64."""
    scores = logits_E.softmax(-1) if score_func == "softmax" else logits_E.sigmoid()
    post = score_func == "softmax" and not softmax_before_topk
    choice = (logits_E if post else scores).clone()
    if bias_E is not None:
        choice = choice + bias_E.double()
    E = logits_E.shape[0]
    if num_groups > 1:
        size = E // num_groups
        group_scores = [
            sorted(choice[g * size : (g + 1) * size].tolist(), reverse=True)[:2]
            for g in range(num_groups)
        ]
        group_scores = [sum(s) for s in group_scores]
        best = sorted(range(num_groups), key=lambda g: -group_scores[g])[:topk_groups]
        for e in range(E):
            if e // size not in best:
                choice[e] = -math.inf
    ids = sorted(range(E), key=lambda e: -choice[e].item())[:k]
    if post:
        weights = logits_E[ids].softmax(-1)
    else:
        weights = scores[ids]
        if normalize:
            weights = weights / weights.sum()
    return ids, weights * scale


def keep_mask(expert_ids, weights, num_experts, capacity, policy):
    """keep[t][j] under GShard-style capacity: position = first choices first, in token order;
    probs = highest weight first (ties by that same pair order)."""
    T, K = len(expert_ids), len(expert_ids[0]) if expert_ids else 0
    pairs = [(j, t) for j in range(K) for t in range(T)]
    if policy == "probs":
        pairs = sorted(pairs, key=lambda p: -float(weights[p[1]][p[0]]))
    keep = [[True] * K for _ in range(T)]
    if capacity is None:
        return keep
    used = [0] * num_experts
    for j, t in pairs:
        e = expert_ids[t][j]
        keep[t][j] = used[e] < capacity
        used[e] += 1
    return keep


def load_balance(probs_TE, expert_ids_TK):
    T, E = probs_TE.shape
    K = len(expert_ids_TK[0])
    loss = 0.0
    for e in range(E):
        f = sum(1 for t in range(T) for j in range(K) if expert_ids_TK[t][j] == e) / (T * K)
        p = sum(probs_TE[t, e] for t in range(T)) / T
        loss = loss + E * f * p
    return loss


def z_loss(logits_TE):
    return (
        sum(torch.logsumexp(logits_TE[t], -1) ** 2 for t in range(logits_TE.shape[0]))
        / (logits_TE.shape[0])
    )
