"""Per-rank bytes of GroupedApply's optimizer state and fp32 master weights that stay in device
memory, with offload None / "optimizer" / "all", at dp 2 x ep 2 (ddp and fsdp, fp32 and bf16
parameters) on 4 gloo ranks, next to moe.memory.estimate_memory's `optimizer_state` for the same
layout.

    torchrun --nproc-per-node 4 -m bench.offload_memory     # from the repository root

On CPU host and device are the same memory, so "device" bytes are counted as the optimizer
state tensors (AdamW's exp_avg, exp_avg_sq; 0-dim step counts excluded) and fp32 masters of
this rank's shards that are NOT in GroupedApply's host store (the inner optimizers' host
shadows and their state). On a GPU the same count is the state on the CUDA device.
The model is bench.memory's (2 blocks, d_model 64, d_ff 256, 8 experts, vocab 64).
"""

import torch
import torch.distributed as dist

from bench.common import gather_on_four_gloo_ranks
from bench.memory import BenchConfig
from moe.memory import GroupedApply, estimate_memory
from moe.parallel import init_mesh, parallelize

CFG = BenchConfig(n_layers=2, d_model=64, n_heads=4, d_ff=256, num_experts=8, top_k=2,
                  seq_len=16, vocab=64)  # fmt: skip
CASES = [(mode, dtype, offload) for mode in ("ddp", "fsdp")
         for dtype in (torch.float32, torch.bfloat16)
         for offload in (None, "optimizer", "all")]  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def device_state_bytes(opt: GroupedApply) -> tuple[int, int]:
    """(optimizer state bytes, fp32 master bytes) of this rank held outside the host store."""
    host = set()
    if opt.offload is not None:
        for inner in opt._inner:
            for shadow, state in inner.state.items():
                host.add(shadow.untyped_storage().data_ptr())
                host |= {v.untyped_storage().data_ptr() for v in state.values() if v.dim() > 0}
    state_bytes = master_bytes = 0
    for p in opt.params:
        for key, v in opt.state_of(p).items():
            t = _local(v)
            if t.dim() == 0 or t.untyped_storage().data_ptr() in host:
                continue
            if key == "master":
                master_bytes += t.numel() * t.element_size()
            else:
                state_bytes += t.numel() * t.element_size()
    return state_bytes, master_bytes


def measure_rank() -> torch.Tensor:
    rows = []
    for mode, dtype, offload in CASES:
        torch.manual_seed(0)
        model = parallelize(CFG.build().to(dtype), init_mesh(dp=2, ep=2), mode)
        opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 2, offload, lr=1e-3)
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
        model(tokens).float().square().mean().backward()
        opt.step()
        rows.append(device_state_bytes(opt))
    return torch.tensor(rows, dtype=torch.int64)


def predict(mode: str, dtype: torch.dtype, offload: str | None) -> int:
    plan = estimate_memory(CFG, world_size=4, dp=2, ep=2, dtype=dtype, offload=offload,
                       data_parallel=mode)  # fmt: skip
    return plan.optimizer_state


def main() -> None:
    every = gather_on_four_gloo_ranks("offload_memory", measure_rank)
    if every is not None:
        print("| mode | dtype | offload | state bytes (rank 0..3) | master bytes (rank 0..3) "
              "| planner optimizer_state |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for i, (mode, dtype, offload) in enumerate(CASES):
            state = " / ".join(str(int(r[i][0])) for r in every)
            master = " / ".join(str(int(r[i][1])) for r in every)
            name = str(dtype).removeprefix("torch.")
            print(f"| {mode} | {name} | {offload} | {state} | {master} "
                  f"| {predict(mode, dtype, offload)} |")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
