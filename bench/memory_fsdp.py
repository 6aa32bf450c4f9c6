"""Per-rank bytes of parameters + gradients + AdamW state, measured from the local shards each
rank holds, ddp vs fsdp at (dp, ep) = (4,1), (2,2), (1,4) on 4 gloo ranks, next to
moe.memory.estimate_memory's prediction for the same layout (its local_params x 4 B x (parameter +
gradient + 2 AdamW moments); docs/parallelism.md).

    torchrun --nproc-per-node 4 -m bench.memory_fsdp     # from the repository root

The model is bench.memory's (the planner's model-config protocol: MoE in every block, tied
head), 2 blocks, d_model 64, d_ff 256, 8 experts, vocab 64, fp32.
"""

import torch
import torch.distributed as dist

from bench.common import gather_on_four_gloo_ranks
from bench.memory import BenchConfig
from moe.memory import estimate_memory
from moe.parallel import init_mesh, parallelize

LAYOUTS = [(4, 1), (2, 2), (1, 4)]
MODES = ("ddp", "fsdp")
CFG = BenchConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, num_experts=8, top_k=2,
                  seq_len=16, vocab=64)  # fmt: skip


def build():
    torch.manual_seed(0)
    return CFG.build()


def _bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure_rank() -> torch.Tensor:
    """[modes x layouts, 3]: this rank's parameter, gradient and AdamW state bytes."""
    rows = []
    for mode in MODES:
        for dp, ep in LAYOUTS:
            model = parallelize(build(), init_mesh(dp=dp, ep=ep), mode)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))).square().mean().backward()
            opt.step()
            params = sum(_bytes(p) for p in model.parameters())
            grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
            state = sum(_bytes(v) for s in opt.state.values() for v in s.values() if v.dim())
            rows.append((params, grads, state))
    return torch.tensor(rows, dtype=torch.int64)


def predict(mode, dp, ep):
    """moe.memory.estimate_memory's persistent bytes per device for this layout."""
    p = estimate_memory(
        CFG, world_size=dp * ep, dp=dp, ep=ep, dtype=torch.float32, data_parallel=mode
    )
    return p.local_params * 4 * 4  # params + grads + 2 AdamW moments, fp32


def main() -> None:
    every = gather_on_four_gloo_ranks("memory_fsdp", measure_rank)
    if every is not None:
        print(
            "| mode | dp | ep | params | grads | AdamW state | total (rank 0) | max over ranks "
            "| planner |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        layouts = [(mode, dp, ep) for mode in MODES for dp, ep in LAYOUTS]
        for i, (mode, dp, ep) in enumerate(layouts):
            params, grads, state = every[0][i].tolist()
            worst = max(int(r[i].sum()) for r in every)
            print(
                f"| {mode} | {dp} | {ep} | {params} | {grads} | {state} | {params + grads + state}"
                f" | {worst} | {predict(mode, dp, ep):.0f} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
