"""Per-rank bytes of parameters + gradients + AdamW state, measured from the local shards each
rank holds, ddp vs fsdp at (dp, ep) = (4,1), (2,2), (1,4) on 4 gloo ranks, next to
moe.memory.plan_memory's prediction for the same layout (its local_params x 4 B x (parameter +
gradient + 2 AdamW moments); docs/parallelism.md).

    PYTHONPATH=. python bench/memory_fsdp.py
"""

import torch

from moe.parallel import init_mesh, parallelize, plan
from tests.distributed import run_ranks
from tests.test_planner import TinyConfig

LAYOUTS = [(4, 1), (2, 2), (1, 4)]
CFG = TinyConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, vocab_size=64, seq_len=16,
                 num_experts=8, moe_every=1)  # fmt: skip


def build():
    torch.manual_seed(0)
    return CFG.build()


def _bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _body(rank, world):
    rows = []
    for mode in ("ddp", "fsdp"):
        for dp, ep in LAYOUTS:
            model = parallelize(build(), init_mesh(dp=dp, ep=ep), mode)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))).square().mean().backward()
            opt.step()
            params = sum(_bytes(p) for p in model.parameters())
            grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
            state = sum(_bytes(v) for s in opt.state.values() for v in s.values() if v.dim())
            rows.append((mode, dp, ep, params, grads, state))
    return rows


def predict(mode, dp, ep):
    """moe.memory.plan_memory's persistent bytes per device for this layout."""
    p = plan(CFG, world_size=dp * ep, dp=dp, ep=ep, dtype=torch.float32, data_parallel=mode)
    return p.local_params * 4 * 4  # params + grads + 2 AdamW moments, fp32


if __name__ == "__main__":
    results = run_ranks(_body, 4, timeout=600)
    print(
        "| mode | dp | ep | params | grads | AdamW state | total (rank 0) | max over ranks "
        "| planner |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i, (mode, dp, ep, params, grads, state) in enumerate(results[0]):
        worst = max(sum(r[i][3:]) for r in results)
        print(
            f"| {mode} | {dp} | {ep} | {params} | {grads} | {state} | {params + grads + state}"
            f" | {worst} | {predict(mode, dp, ep):.0f} |"
        )
