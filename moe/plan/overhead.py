"""Fixed framework costs of a training step, measured by `python -m moe.plan profile` on
generic tiny modules (not the model being planned): what a step costs beyond its FLOPs and
bytes when the tensors are so small that eager dispatch, autograd bookkeeping, the router's
sorting and the optimizer's per-tensor launches dominate (CPU runs, tiny models; on a GPU at
the presets' sizes these are microseconds against milliseconds and the presets keep 0).

At width `d` = 8 and 4 tokens (the FLOPs are negligible), median of `repeats` calls, on a
reference decoder block: by default one layer of a tiny transformers Mixtral converted by
moe.from_hf and cut by moe.pipeline.hf_stack (RMSNorm, rotary, grouped-query attention, the
per-layer causal mask: a block as the Hugging Face families the planner reads build it);
without transformers, or with reference="generic", a minimal pre-norm block (LayerNorm,
q/k/v/out projections, causal SDPA, a SwiGLU MLP or a moe.MoELayer):
  block_overhead      forward + backward of the block with a dense SwiGLU MLP
  moe_overhead        the block with its MoE layer (4 experts, top-2), minus block_overhead:
                      the router, permutation and grouped GEMM
  step_overhead       forward + backward of the embedding, final norm, head and the
                      cross-entropy loss (once per micro-batch)
  optimizer_overhead  moe.memory.GroupedApply(AdamW) step over the MoE block's parameters
and, a memory figure of the same software stack, optimizer_temp_bytes: the bytes per
parameter (and per element of the largest tensor) a GroupedApply(AdamW) step allocates
beyond its state (predict's temporaries; the presets keep the 8 B of a foreach step's fp32
gradient copy and denominator, and 0).
collective_latency (moe.plan.profile) is the time of a 4-byte all_reduce over the world.
The profile measures these four on CPU runs only (a CUDA profile keeps 0: its modules would
have to run on the device, and at the sizes GPUs are planned for they are noise).
"""

from __future__ import annotations

import copy
import importlib.util
import statistics
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

D, T, E = 8, 4, 4


class _Block(nn.Module):
    def __init__(self, ffn: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D, dtype=dtype), nn.LayerNorm(D, dtype=dtype)
        self.qkv = nn.Linear(D, 3 * D, bias=False, dtype=dtype)
        self.out = nn.Linear(D, D, bias=False, dtype=dtype)
        self.ffn = ffn

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q, k, v = self.qkv(self.ln1(x_BSD)).view(B, S, 3, 2, D // 2).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x_BSD = x_BSD + self.out(y.transpose(1, 2).reshape(B, S, D))
        return x_BSD + self.ffn(self.ln2(x_BSD))


class _SwiGLU(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.up = nn.Linear(D, 2 * D, bias=False, dtype=dtype)
        self.down = nn.Linear(D, D, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(x).chunk(2, -1)
        return self.down(F.silu(a) * b)


def _median_time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def _fwd_bwd(module: nn.Module, x: torch.Tensor):
    def run():
        module(x.clone().requires_grad_()).float().sum().backward()
        module.zero_grad(set_to_none=True)

    return run


def _hf_reference(dtype: torch.dtype):
    """(dense block, MoE block, embedding + head) of a 1-layer tiny transformers Mixtral
    converted by moe.from_hf and cut by moe.pipeline.hf_stack: a decoder block as the
    families the planner reads build it (RMSNorm, rotary, GQA, the causal mask per layer)."""
    import transformers

    import moe
    from moe.pipeline import hf_stack

    cfg = transformers.MixtralConfig(
        vocab_size=16, hidden_size=D, intermediate_size=D, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T,
        num_local_experts=E, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = moe.from_hf(transformers.MixtralForCausalLM(cfg)).to(dtype)
    embed, layer, head = hf_stack(model)
    moe_block = copy.deepcopy(layer)
    (path, _), *_ = moe.moe_layers(layer)
    parent, _, leaf = path.rpartition(".")
    setattr(layer.get_submodule(parent), leaf, _SwiGLU(dtype))
    return layer, moe_block, embed, head


class _NewBytes(TorchDispatchMode):
    """Live and peak bytes of the storages ops create while active (freed ones subtracted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in seen:
                n = t.untyped_storage().nbytes()
                seen.add(id(t.untyped_storage()))
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t.untyped_storage(), self._free, n)
        return out

    def _free(self, n: int) -> None:
        self.live -= n


def _step_peak(sizes: list[int], dtype: torch.dtype) -> float:
    """Peak bytes a GroupedApply(AdamW) step (torch's default foreach choice) allocates on top
    of its state and gradients over parameters of `sizes` elements."""
    from moe.memory import GroupedApply

    params = [nn.Parameter(torch.randn(n, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = GroupedApply(params, torch.optim.AdamW, 1, None, lr=1e-6)
    opt.step()  # the state
    counter = _NewBytes()
    with counter:  # gradients made under the counter: a step that frees them is counted
        for p in params:
            p.grad = torch.randn_like(p)
        counter.peak = start = counter.live
        opt.step()
    return counter.peak - start


def optimizer_temp_bytes(dtype: torch.dtype = torch.bfloat16, n: int = 1 << 14) -> tuple:
    """(bytes per parameter, bytes per element of the largest tensor) a GroupedApply(AdamW)
    step allocates beyond its state and gradients, as a + b: from 4 tensors of n elements
    (4n a + n b) and one of 4n (4n a + 4n b). A foreach step holds its temporaries for every
    tensor at once (b = 0), a per-tensor step (torch's CPU default) the fp32 gradient copies
    for all and one tensor's temporaries at a time."""
    equal, one = _step_peak([n] * 4, dtype), _step_peak([4 * n], dtype)
    b = max((one - equal) / (3 * n), 0.0)
    return max((equal - n * b) / (4 * n), 0.0), b


def measure_overheads(
    dtype: torch.dtype = torch.float32, repeats: int = 30, reference: str = "hf"
) -> dict[str, float]:
    """The four fixed costs (seconds) of this machine and dtype (see the module docstring);
    reference "hf" (a transformers Mixtral block, when transformers is installed) or
    "generic" (the minimal block above)."""
    import moe
    from moe.memory import GroupedApply

    torch.manual_seed(0)
    x = torch.randn(1, T, D, dtype=dtype)
    tokens = torch.randint(16, (1, T))
    if reference == "hf" and importlib.util.find_spec("transformers") is not None:
        dense, moe_block, embed, head = _hf_reference(dtype)
    else:
        dense = _Block(_SwiGLU(dtype), dtype)
        layer = moe.MoELayer(D, D, E, top_k=2, activation="swiglu", backend="torch")
        moe_block = _Block(layer.to(dtype), dtype)
        embed = nn.Embedding(16, D, dtype=dtype)
        head = nn.Sequential(
            nn.LayerNorm(D, dtype=dtype), nn.Linear(D, 16, bias=False, dtype=dtype)
        )
    t_dense = _median_time(_fwd_bwd(dense, x), repeats)
    t_moe = _median_time(_fwd_bwd(moe_block, x), repeats)

    def ends():
        logits = head(embed(tokens))
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

    t_ends = _median_time(ends, repeats)
    for p in moe_block.parameters():
        p.grad = torch.randn_like(p)
    opt = GroupedApply(moe_block.named_parameters(), torch.optim.AdamW, 1, None, lr=1e-6)
    t_opt = _median_time(opt.step, repeats)
    out = {
        "block_overhead": t_dense,
        "moe_overhead": max(t_moe - t_dense, 0.0),
        "step_overhead": t_ends,
        "optimizer_overhead": t_opt,
    }
    out["optimizer_temp_bytes"], out["optimizer_tensor_temp_bytes"] = optimizer_temp_bytes(dtype)
    return out
