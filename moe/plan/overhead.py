"""Fixed framework costs of a training step, measured by `python -m moe.plan profile` on
generic tiny modules (not the model being planned): what a step costs beyond its FLOPs and
bytes when the tensors are so small that eager dispatch, autograd bookkeeping, the router's
sorting and the optimizer's per-tensor launches dominate (CPU runs, tiny models; on a GPU at
the presets' sizes these are microseconds against milliseconds and the presets keep 0).

At width `d` = 8 and 4 tokens (the FLOPs are negligible), median of `repeats` calls after
WARMUP (the fastest of ROUNDS rounds; under torch.distributed the median over the ranks), on
a reference decoder block: by default one layer of a tiny
transformers Mixtral converted by moe.from_hf and cut by moe.pipeline.hf_stack (RMSNorm,
rotary, grouped-query attention, the per-layer causal mask: a block as the Hugging Face
families the planner reads build it);
without transformers, or with reference="generic", a minimal pre-norm block (LayerNorm,
q/k/v/out projections, causal SDPA, a SwiGLU MLP or a moe.MoELayer):
  block_overhead      forward + backward of the block with a dense SwiGLU MLP
  moe_overhead        the block with its MoE layer (4 experts, top-2), minus block_overhead:
                      the router, permutation and grouped GEMM
  step_overhead       forward + backward of the embedding, final norm, head and the
                      cross-entropy loss (once per micro-batch)
  optimizer_overhead  moe.memory.GroupedApply(AdamW) step over the MoE block's parameters
  offload_overhead    the same step offloaded (offload="optimizer": plain host tensors,
                      however the parameters are sharded; on a CPU it skips DTensor dispatch)
and, a memory figure of the same software stack, optimizer_temp_bytes: the bytes per
parameter (and per element of the largest tensor) a GroupedApply(AdamW) step allocates
beyond its state (predict's temporaries; the presets keep the 8 B of a foreach step's fp32
gradient copy and denominator, and 0).
With size and rate (measure_overheads) the same references are timed at the model's widths
and a micro-batch's tokens: block_token_overhead, moe_token_overhead, step_token_overhead
per token beyond the GEMM time predict counts there, and optimizer_param_overhead and
offload_param_overhead per parameter. Under torch.distributed (the profile under torchrun)
every reference module is first parallelized on a mesh of its rank alone, so its parameters
are DTensors with FSDP2's hooks as in every parallelized training step (on a 2-core CPU that
doubled the step's cost over plain tensors), and the ranks time each module at the same
moment (a barrier before each), sharing the machine as the ranks of a step do; with more
than one rank the MoE block is also parallelized over the world as "ddp" and "fsdp":
ddp_call_latency and fsdp_call_latency, one data-parallel collective per unit as FSDP2
issues it; and with its experts over the world (ep = world): ep_block_extra, expert
parallelism's machinery.
collective_latency (moe.plan.profile) is the time of a 4-byte all_reduce over the world.
The profile measures these on CPU runs only (a CUDA profile keeps 0: its modules would have
to run on the device, and at the sizes GPUs are planned for they are noise).
"""

from __future__ import annotations

import copy
import importlib.util
import statistics
import time
import weakref

import torch
import torch.distributed as dist
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
    def __init__(self, dtype: torch.dtype, d: int = D, f: int = D):
        super().__init__()
        self.up = nn.Linear(d, 2 * f, bias=False, dtype=dtype)
        self.down = nn.Linear(f, d, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(x).chunk(2, -1)
        return self.down(F.silu(a) * b)


# Rounds over the reference modules (the fastest kept): on the 2-core machine a profile's
# figures moved by up to 1.7x between runs, as the same layout's step time did between passes
ROUNDS = 5
# calls before timing: a new process's first rounds ran up to 1.7x slower than its later ones
WARMUP = 10


def _median_time(fn, repeats: int) -> float:
    for _ in range(WARMUP):
        fn()
    if dist.is_initialized():
        dist.barrier()  # every rank times at once: they share the machine as in a step
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


def _hf_config(d: int = D, f: int = D, t: int = T):
    import transformers

    return transformers.MixtralConfig(
        vocab_size=16, hidden_size=d, intermediate_size=f, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=t,
        num_local_experts=E, num_experts_per_tok=2,
    )  # fmt: skip


def _hf_reference(dtype: torch.dtype, d: int = D, f: int = D, t: int = T):
    """(dense block, MoE block, embedding + head) of a 1-layer tiny transformers Mixtral
    converted by moe.from_hf and cut by moe.pipeline.hf_stack: a decoder block as the
    families the planner reads build it (RMSNorm, rotary, GQA, the causal mask per layer)."""
    import transformers

    import moe
    from moe.pipeline import hf_stack

    cfg = _hf_config(d, f, t)
    torch.manual_seed(0)
    model = moe.from_hf(transformers.MixtralForCausalLM(cfg)).to(dtype)
    embed, layer, head = hf_stack(model)
    moe_block = copy.deepcopy(layer)
    (path, _), *_ = moe.moe_layers(layer)
    parent, _, leaf = path.rpartition(".")
    setattr(layer.get_submodule(parent), leaf, _SwiGLU(dtype, d, f))
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
    step allocates beyond its state and gradients, as a + b: from 4 and 8 tensors of n
    elements (4n a + n b, 8n a + n b). A foreach step holds its temporaries for every tensor
    at once (b = 0), a per-tensor step (torch's CPU default) the fp32 gradient copies for all
    (a = 4) and one tensor's temporaries at a time, plus what the previous tensor's step
    still holds (its last temporaries live until the next tensor's replace them: b = 12 for
    torch's AdamW, for a largest tensor next to one of its size, as a layer's stacked expert
    projections are)."""
    four, eight = _step_peak([n] * 4, dtype), _step_peak([n] * 8, dtype)
    a = max((eight - four) / (4 * n), 0.0)
    return a, max((four - 4 * n * a) / n, 0.0)


def _alone_mesh():
    """A ("rank", "dp", "ep") mesh whose ("dp", "ep") slice is this rank alone (every rank
    calls): parallelized modules without traffic between ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("rank", "dp", "ep"))


def _parallelized(dense: nn.Module, moe_block: nn.Module, ends: nn.ModuleList) -> tuple:
    """The reference modules as a training step runs them, on a mesh of this rank alone (every
    rank calls): the MoE block by moe.parallelize, the others by FSDP2 (as parallelize wraps a
    model's dense parts): DTensor parameters and FSDP2 hooks, no traffic between ranks."""
    from torch.distributed.fsdp import fully_shard

    from moe.parallel import parallelize

    mesh = _alone_mesh()
    parallelize(moe_block, mesh["dp", "ep"])
    for m in (dense, *ends):
        fully_shard(m, mesh=mesh["dp"])
    return dense, moe_block, ends


def _reference_modules(dtype, reference: str, d=D, f=D, t=T) -> tuple:
    """(dense block, MoE block, embedding, head) of the reference at width d, expert width f."""
    import moe

    torch.manual_seed(0)
    if reference == "hf" and importlib.util.find_spec("transformers") is not None:
        return _hf_reference(dtype, d, f, t)
    layer = moe.MoELayer(D, D, E, top_k=2, activation="swiglu", backend="torch")
    head = nn.Sequential(nn.LayerNorm(D, dtype=dtype), nn.Linear(D, 16, bias=False, dtype=dtype))
    return (
        _Block(_SwiGLU(dtype), dtype),
        _Block(layer.to(dtype), dtype),
        nn.Embedding(16, D, dtype=dtype),
        head,
    )


def _reference_times(dtype, repeats: int, reference: str, d=D, f=D, t=T):
    """(dense block, MoE block, embedding + head + loss) fwd + bwd seconds at width d, expert
    width f and t tokens, and the MoE block (for the optimizer's figure)."""
    dense, moe_block, embed, head = _reference_modules(dtype, reference, d, f, t)
    x = torch.randn(1, t, d, dtype=dtype)
    tokens = torch.randint(16, (1, t))
    if dist.is_initialized():
        dense, moe_block, ends = _parallelized(dense, moe_block, nn.ModuleList([embed, head]))
        embed, head = ends

    def ends():
        logits = head(embed(tokens))
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

    fns = (_fwd_bwd(dense, x), _fwd_bwd(moe_block, x), ends)
    rounds = [[_median_time(fn, repeats) for fn in fns] for _ in range(ROUNDS)]
    return [min(r) for r in zip(*rounds)], moe_block


def _gemm_seconds(d: int, f: int, t: int, rate) -> list[float]:
    """What moe.plan.predict counts as GEMM time (fwd + bwd: 3 x the forward's FLOPs at
    rate(rows)) for each reference module at (d, f, t): the part of a measured time that is
    not a fixed cost."""
    from moe.plan.spec import from_hf_config

    spec = from_hf_config(_hf_config(d, f, t).to_dict())
    attn_router, routed = spec.layer_flops(0, t)
    attn = attn_router - 2 * d * E
    dense = (attn + 6 * d * f) * t / rate(t)
    moe = attn_router * t / rate(t) + routed * t / rate(max(t * spec.top_k / E, 1.0))
    return [3 * dense, 3 * moe, 3 * spec.head_flops() * t / rate(t)]


def _dp_calls(dtype, repeats: int, reference: str) -> dict[str, float]:
    """Seconds per data-parallel collective as FSDP2 issues them over the world (every rank
    calls), waiting for the other ranks included as in a step: the reference MoE block
    parallelized over all ranks as "ddp" (an all-reduce per unit a step) or "fsdp" (two
    all-gathers and a reduce-scatter per unit) against the same block on its rank alone.
    And ep_block_extra: the block with its experts over all ranks (ep = world, where E
    divides) beyond it alone and its one dense all-reduce: expert parallelism's machinery
    (the count exchange, the permutations around the exchanges, the exchanges' calls), of
    which moe.plan.profile keeps what its all-to-all model does not count (ep_overhead)."""
    from torch.distributed.fsdp import FSDPModule

    from moe.parallel import ParallelConfig, init_mesh, parallelize

    world = dist.get_world_size()
    x = torch.randn(1, T, D, dtype=dtype)
    alone = _alone_mesh()
    times, units = {}, {}
    meshes = {"alone": lambda: alone["dp", "ep"], "ddp": lambda: init_mesh(dp=world),
              "fsdp": lambda: init_mesh(dp=world), "ep": lambda: init_mesh(ep=world)}  # fmt: skip
    for mode, mesh in meshes.items():
        if mode == "ep" and E % world:
            continue
        _, block, _, _ = _reference_modules(dtype, reference)
        parallelize(block, mesh(), config=ParallelConfig("fsdp" if mode == "fsdp" else "ddp"))
        units[mode] = sum(isinstance(m, FSDPModule) for m in block.modules())
        times[mode] = min(_median_time(_fwd_bwd(block, x), repeats) for _ in range(ROUNDS))
    out = {
        f"{mode}_call_latency": max(times[mode] - times["alone"], 0.0) / (units[mode] * calls)
        for mode, calls in (("ddp", 1), ("fsdp", 3))
    }
    if "ep" in times:  # the dense parts: one unit all-reduced over the world
        out["ep_block_extra"] = times["ep"] - times["alone"] - out["ddp_call_latency"]
    return out


def _optimizer_time(block: nn.Module, offload: str | None, repeats: int) -> float:
    """Seconds of a GroupedApply(AdamW) step over block's parameters (offload: its host
    path, plain host tensors however the parameters are sharded), the fastest of ROUNDS."""
    from moe.memory import GroupedApply

    for p in block.parameters():
        p.grad = torch.randn_like(p)
    opt = GroupedApply(block.named_parameters(), torch.optim.AdamW, 1, offload, lr=1e-6)
    return min(_median_time(opt.step, repeats) for _ in range(ROUNDS))


def measure_overheads(
    dtype: torch.dtype = torch.float32,
    repeats: int = 30,
    reference: str = "hf",
    size: tuple[int, int, int] | None = None,
    rate=None,
) -> dict[str, float]:
    """The fixed costs (seconds) of this machine and dtype (see the module docstring);
    reference "hf" (a transformers Mixtral block, when transformers is installed) or
    "generic" (the minimal block above). With size = (d_model, d_ff, tokens) and rate (the
    profile's GEMM FLOP/s at a row count) the "hf" reference is also timed at the model's
    widths and a micro-batch's tokens: what it costs there beyond the fixed costs and the
    GEMM time predict counts grows with the tokens (norms, rotary, softmax, casts), the
    *_token_overhead figures (per token); and the optimizer's seconds per parameter there
    (optimizer_param_overhead: on CPUs far above the bytes over memory bandwidth)."""
    (t_dense, t_moe, t_ends), moe_block = _reference_times(dtype, repeats, reference)
    t_opt, t_off = (_optimizer_time(moe_block, off, repeats) for off in (None, "optimizer"))
    out = {
        "block_overhead": t_dense,
        "moe_overhead": max(t_moe - t_dense, 0.0),
        "step_overhead": t_ends,
        "optimizer_overhead": t_opt,
        "offload_overhead": t_off,
    }
    if size is not None and reference == "hf" and importlib.util.find_spec("transformers"):
        d, f, t = size
        big_repeats = max(repeats // 2, 5)
        big, big_block = _reference_times(dtype, big_repeats, reference, d, f, t)
        n = sum(p.numel() for p in big_block.parameters())
        for key, off, small_time in (("optimizer", None, t_opt), ("offload", "optimizer", t_off)):
            t_big = _optimizer_time(big_block, off, big_repeats)
            out[f"{key}_param_overhead"] = max(t_big - small_time, 0.0) / n
        small = (t_dense, t_moe, t_ends)
        extra = [
            max(b - g - s, 0.0) / (t - T)
            for b, g, s in zip(big, _gemm_seconds(d, f, t, rate), small)
        ]
        out["block_token_overhead"] = extra[0]
        out["moe_token_overhead"] = max(extra[1] - extra[0], 0.0)
        out["step_token_overhead"] = extra[2]
    if dist.is_initialized() and dist.get_world_size() > 1:
        out.update(_dp_calls(dtype, repeats, reference))
    out["optimizer_temp_bytes"], out["optimizer_tensor_temp_bytes"] = optimizer_temp_bytes(dtype)
    return _median_over_ranks(out)


def _median_over_ranks(figures: dict[str, float]) -> dict[str, float]:
    """Each figure's median over the ranks (every rank calls): one rank's fastest round
    still moved by 1.5x between ranks measuring at the same moment."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return figures
    mine = torch.tensor(list(figures.values()), dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    medians = torch.stack(every).quantile(0.5, dim=0)
    return dict(zip(figures, medians.tolist(), strict=True))
