"""Per-rank bytes of parameters + gradients + AdamW state, measured from the local shards each
rank holds, ddp vs fsdp at (dp, ep) = (4,1), (2,2), (1,4) on 4 gloo ranks, next to the layout's
prediction (dense x 1 or 1/W, experts x 1/ep or 1/W; docs/parallelism.md).

    PYTHONPATH=. python bench/memory_fsdp.py
"""

import torch
from torch import nn

import moe
from moe.parallel import expert_parameters, init_mesh, parallelize
from tests.distributed import run_ranks

D, F, E = 64, 256, 8
LAYOUTS = [(4, 1), (2, 2), (1, 4)]


def build():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, D), moe.MoELayer(D, F, E, top_k=2), nn.Linear(D, D), moe.MoELayer(D, F, E)
    )


def _bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _body(rank, world):
    rows = []
    for mode in ("ddp", "fsdp"):
        for dp, ep in LAYOUTS:
            model = parallelize(build(), init_mesh(dp=dp, ep=ep), mode)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.randn(16, D)).square().mean().backward()
            opt.step()
            params = sum(_bytes(p) for p in model.parameters())
            grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
            state = sum(_bytes(v) for s in opt.state.values() for v in s.values() if v.dim())
            rows.append((mode, dp, ep, params, grads, state))
    return rows


def predict(mode, dp, ep):
    model = build()
    experts = sum(p.numel() * 4 for _, p in expert_parameters(model))
    dense = sum(p.numel() * 4 for p in model.parameters()) - experts
    world = dp * ep
    per = dense / world + experts / world if mode == "fsdp" else dense + experts / ep
    return per * 4  # params + grads + 2 AdamW moments


if __name__ == "__main__":
    results = run_ranks(_body, 4, timeout=600)
    print(
        "| mode | dp | ep | params | grads | AdamW state | total (rank 0) | max over ranks "
        "| predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i, (mode, dp, ep, params, grads, state) in enumerate(results[0]):
        worst = max(sum(r[i][3:]) for r in results)
        print(
            f"| {mode} | {dp} | {ep} | {params} | {grads} | {state} | {params + grads + state}"
            f" | {worst} | {predict(mode, dp, ep):.0f} |"
        )
