"""Peak memory and step time of plain AdamW vs GroupedApply (G = 2, 4, 8), + CPU offload,
+ activation checkpointing, side by side on one MoE transformer; then the memory plan of
the M6 1T configuration on 480 x V100-32GB.

    python -m bench.memory [--layers 8 --d-model 512 --iters 3]

What is measured:
  CUDA: torch.cuda.max_memory_allocated (peak of the whole training step, and the
        optimizer step's extra peak over what was allocated before it), device-resident
        optimizer state bytes, median step time.
  CPU:  host and device are the same memory, so a tensor allocation counter (a
        TorchDispatchMode that adds the bytes of every new storage an op returns and
        subtracts them when the storage is freed) gives the same two peaks in tracked
        tensor bytes. It sees every op output (the foreach optimizer's temporaries
        included) but not scratch memory inside a single kernel. Optimizer state is
        classified as device or host by where GroupedApply keeps it (offload = host).
"""

import argparse
import gc
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import moe
from bench.common import device_name, time_interleaved, write_report
from moe.memory import GroupedApply, estimate_memory, recompute_blocks

GiB, MiB = 2**30, 2**20


# -- measuring ---------------------------------------------------------------------------
class AllocationCounter(TorchDispatchMode):
    """Live and peak bytes of tensor storages created by ops while active (CPU stand-in for
    torch.cuda.max_memory_allocated). Outputs that share storage with an input (in-place
    ops, views) are not new allocations."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_meta
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs: set[int]) -> None:
        key = id(storage)
        if key in inputs or key in self._tracked:
            return
        n = storage.nbytes()
        self._tracked.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self._tracked.discard(key)
        self.live -= n


class PeakMeter:
    """`with meter.track() as m: ...; m.peak` on CUDA (allocator) or CPU (counter)."""

    def __init__(self, device: torch.device):
        self.device = device

    def track(self):
        return _CudaPeak(self.device) if self.device.type == "cuda" else _CpuPeak()


class _CudaPeak:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self.start


class _CpuPeak:
    def __enter__(self):
        self.counter = AllocationCounter().__enter__()
        return self

    def __exit__(self, *exc):
        self.counter.__exit__(*exc)
        self.peak = self.counter.peak


# -- the model ---------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int, experts: int, top_k: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.ffn = moe.MoELayer(d, d_ff, experts, top_k=top_k, capacity_factor=1.25)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(self.ln1(x_BSD)).view(B, S, 3, self.heads, -1).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x_BSD = x_BSD + self.out(y.transpose(1, 2).reshape(B, S, D))
        return x_BSD + self.ffn(self.ln2(x_BSD))


class Model(nn.Module):
    def __init__(self, cfg: "BenchConfig"):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.num_experts, cfg.top_k)
            for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_BS)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.embed.weight.t()


class BenchConfig:
    """The planner's model-config protocol (MoE in every block, tied head)."""

    def __init__(self, n_layers, d_model, n_heads, d_ff, num_experts, top_k, seq_len, vocab):
        self.n_layers, self.d_model, self.n_heads, self.d_ff = n_layers, d_model, n_heads, d_ff
        self.num_experts, self.top_k, self.seq_len, self.vocab_size = (
            num_experts,
            top_k,
            seq_len,
            vocab,
        )
        self.moe_every, self.capacity_factor = 1, 1.25

    def build(self) -> nn.Module:
        return Model(self)


# -- variants ----------------------------------------------------------------------------
VARIANTS = [
    ("plain AdamW", dict(groups=None)),
    ("grouped G=2", dict(groups=2)),
    ("grouped G=4", dict(groups=4)),
    ("grouped G=8", dict(groups=8)),
    ("G=8 + offload", dict(groups=8, offload="all")),
    ("G=8 + offload + ckpt", dict(groups=8, offload="all", checkpoint=True)),
]


class Run:
    """One variant: its own model copy and optimizer, a training step, measurements."""

    def __init__(self, cfg, state, dtype, device, tokens, groups, offload=None, checkpoint=False):
        self.model = cfg.build().to(device=device, dtype=dtype)
        self.model.load_state_dict(state)
        if checkpoint:
            recompute_blocks(self.model)
        kw = dict(lr=1e-4, weight_decay=0.1)
        if groups is None and dtype == torch.float32:
            self.opt = torch.optim.AdamW(self.model.parameters(), foreach=True, **kw)
        else:
            inner = {} if offload else {"foreach": True}  # low precision: plain = G=1
            self.opt = GroupedApply(
                self.model.named_parameters(),
                torch.optim.AdamW,
                groups or 1,
                offload,
                **inner,
                **kw,
            )
        self.tokens, self.offload, self.device = tokens, offload, device

    def forward_backward(self) -> None:
        logits = self.model(self.tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), self.tokens.flatten())
        (loss + moe.aux_loss(self.model)).backward()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.forward_backward()
        self.opt.step()

    def measure(self, meter: PeakMeter) -> dict:
        self.opt.zero_grad(set_to_none=True)
        with meter.track() as whole:
            self.forward_backward()
            with meter.track() as opt_step:
                self.opt.step()
        if self.device.type == "cuda":  # the outer tracker was reset by the inner one
            with meter.track() as whole:
                self.opt.zero_grad(set_to_none=True)
                self.forward_backward()
                self.opt.step()
        return {
            "step_peak": whole.peak,
            "opt_extra": opt_step.peak,
            **self.resident(),
        }

    def resident(self) -> dict:
        params = list(self.model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        device_state = host_state = 0
        for p in params:
            state = self.opt.state_of(p) if hasattr(self.opt, "state_of") else self.opt.state[p]
            for key, t in state.items():
                if not isinstance(t, torch.Tensor) or (key == "master" and t is p):
                    continue
                n = t.numel() * t.element_size()
                on_host = t.device.type == "cpu" and (self.device.type == "cuda" or self.offload)
                if on_host:
                    host_state += n
                else:
                    device_state += n
        if hasattr(self.opt, "_entries"):  # host weight copies and staging of offload
            host_state += sum(
                e.shadow.numel() * e.shadow.element_size()
                for e in self.opt._entries
                if e.shadow is not e.param and e.shadow is not e.master and self.offload
            )
        if getattr(self.opt, "_pipeline", None) is not None:
            host_state += self.opt._pipeline.staging_bytes
        return {"params": param_bytes, "device_state": device_state, "host_state": host_state}


def size_layers(args, device, dtype) -> int:
    """CUDA: the most layers for which the plain run (params + grads + AdamW state + the
    foreach step's temporaries, ~20 B/param fp32, + activations) fills ~90% of memory."""
    if device.type != "cuda" or args.layers:
        return args.layers or 8
    free, _ = torch.cuda.mem_get_info(device)
    one = BenchConfig(1, args.d_model, args.heads, args.d_ff, args.experts, 2, args.seq, 1000)
    per_layer = sum(p.numel() for p in one.build().to("meta").parameters())
    per_param = 20 if dtype == torch.float32 else 24  # + fp32 masters and grad copies
    act = estimate_memory(
        one, world_size=1, dp=1, ep=1, dtype=dtype, micro_batch_tokens=args.batch * args.seq
    )
    return max(1, int(0.9 * free / (per_layer * per_param + act.activations)))


def m6_plans() -> str:
    try:
        from examples.m6.config import get_config
    except ImportError as e:  # the example is another engineer's work in progress
        return f"(examples.m6 not importable: {e})\n"
    cfg = get_config("m6-1t")
    kw = dict(world_size=480, dp=1, ep=480, dtype=torch.float16, groups=4)
    kw["micro_batch_tokens"] = 8 * cfg.seq_len
    lines = [
        "M6-T 1T (examples/m6 'm6-1t'; its stated assumptions) on 480 x V100-32GB, dp=1 x "
        f"ep=480 (2 experts per GPU per layer), fp16 + fp32 masters, AdamW, G=4, "
        f"micro-batch 8 x {cfg.seq_len} tokens per GPU:\n",
        "```",
    ]
    for offload, ckpt in ((None, False), ("all", False), ("all", True)):
        p = estimate_memory(cfg, **kw, offload=offload, checkpointing=ckpt)
        lines += [str(p), ""]
    lines.append("```")
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=0, help="0: fill the GPU (CPU: 8)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--opt-iters", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", default="float32", help="float32, or bfloat16 (fp32 masters; plain = G=1)"
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    layers = size_layers(args, device, dtype)
    cfg = BenchConfig(layers, args.d_model, args.heads, args.d_ff, args.experts, 2, args.seq, 1000)
    torch.manual_seed(0)
    state = cfg.build().to(dtype=dtype).state_dict()
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    meter = PeakMeter(device)
    results, times, opt_times = {}, {}, {}
    interleave = device.type == "cpu"  # on a near-full GPU only one variant fits at a time
    runs = {}
    for name, options in VARIANTS:
        run = Run(cfg, state, dtype, device, tokens, **options)
        run.step()  # creates the optimizer state
        results[name] = run.measure(meter)
        print(name, {k: f"{v / MiB:.1f} MiB" for k, v in results[name].items()}, flush=True)
        if interleave:
            runs[name] = run
        else:
            times.update(time_interleaved({name: run.step}, args.iters, args.warmup, device))
            opt_times.update(time_interleaved({name: run.opt.step}, args.opt_iters, 1, device))
            del run
            gc.collect()
            torch.cuda.empty_cache()
    if interleave:
        times = time_interleaved(
            {n: r.step for n, r in runs.items()}, args.iters, args.warmup, device
        )
        opt_times = time_interleaved(  # the optimizer step alone, on the last gradients
            {n: r.opt.step for n, r in runs.items()}, args.opt_iters, 1, device
        )
    n_params = sum(p.numel() for p in cfg.build().to("meta").parameters())
    base = results["plain AdamW"]
    header = (
        "| variant | device peak total (MiB) | step peak (MiB) | optimizer-step extra peak "
        "(MiB) | extra vs plain | optimizer state on device (MiB) | on host (MiB) | "
        "step time (ms) | time vs plain | optimizer step (ms) | vs plain |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = "".join(
        f"| {name} | {(r['params'] + r['device_state'] + r['step_peak']) / MiB:.1f} | "
        f"{r['step_peak'] / MiB:.1f} | {r['opt_extra'] / MiB:.1f} | "
        f"{r['opt_extra'] / max(base['opt_extra'], 1):.2f} | {r['device_state'] / MiB:.1f} | "
        f"{r['host_state'] / MiB:.1f} | {times[name] * 1e3:.0f} | "
        f"{times[name] / times['plain AdamW']:.2f} | {opt_times[name] * 1e3:.0f} | "
        f"{opt_times[name] / opt_times['plain AdamW']:.2f} |\n"
        for name, r in results.items()
    )
    offload_cost = times["G=8 + offload"] / times["plain AdamW"] - 1
    offload_vs_grouped = times["G=8 + offload"] / times["grouped G=8"] - 1
    opt_cost = opt_times["G=8 + offload"] / opt_times["plain AdamW"] - 1
    what = (
        "torch.cuda.max_memory_allocated"
        if device.type == "cuda"
        else "tracked tensor bytes (TorchDispatchMode allocation counter; CPU: host = device)"
    )
    report = (
        "# Memory: grouped optimizer apply, CPU offload, activation checkpointing\n\n"
        f"- device: {device_name(device)}\n- torch {torch.__version__}\n"
        f"- command: `python -m bench.memory {' '.join(argv or sys.argv[1:])}`\n"
        f"- model: {layers} blocks, d_model={args.d_model}, {args.heads} heads, "
        f"{args.experts} experts of d_ff={args.d_ff} (top-2, capacity 1.25) in every block, "
        f"{n_params / 1e6:.1f}M parameters, {dtype}; batch {args.batch} x {args.seq} tokens; "
        + (
            "sized to fill ~90% of free GPU memory with plain AdamW\n"
            if device.type == "cuda" and not args.layers
            else "sized by the flags (a CPU has no device memory to fill; chosen so that "
            "both the optimizer state and the activations are visible)\n"
        )
        + f"- measured: {what}. 'step peak' = peak over forward + backward + optimizer step "
        "above the bytes alive before it (parameters, optimizer state); 'optimizer-step "
        "extra peak' = peak during opt.step() above what was alive when it started.\n"
        "- plain = torch.optim.AdamW(foreach=True) (bf16: GroupedApply G=1 with masters); grouped = GroupedApply(AdamW, G, "
        "foreach=True); offload = offload='all' (state on the host, CPU-fused AdamW step); "
        "ckpt = recompute_blocks(model).\n"
        f"- step time: median of {args.iters} "
        f"{'interleaved ' if interleave else ''}iterations of forward + backward + step "
        f"after {args.warmup} warm-up; 'optimizer step' = opt.step() alone on the last "
        f"gradients, median of {args.opt_iters} interleaved calls.\n"
        "- device peak total = parameters + optimizer state on the device + step peak.\n\n"
        + header
        + rows
        + f"\nOffload step-time cost: {offload_cost:+.0%} vs plain AdamW, "
        f"{offload_vs_grouped:+.0%} vs grouped G=8 (target: under +30%); the optimizer "
        f"step alone: {opt_cost:+.0%} vs plain AdamW.\n\n" + m6_plans()
    )
    print(report)
    print("report:", write_report("memory", report, device))
    return report


if __name__ == "__main__":
    main()
