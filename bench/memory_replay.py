"""CPU replay of one MoE layer's forward + backward memory at the GPU benchmark's four shapes.

Each shape (T, d, E, k, F) is scaled down by --scale in T, d and F (E and k kept), run once on
the CPU (the Triton backend under TRITON_INTERPRET=1), and its byte counts are scaled back by
scale**2 (every activation and weight scales with two of T, d, F; routing metadata scales
with T alone and is overstated by the factor: an upper bound). Four layers side by side:
  dense   SwiGLU FFN with the same active parameters (d_ff = k * F), no router
  titan   a torchtitan-style MoE written here: argsort permute, grouped GEMMs, scatter_add
  torch   moe.MoELayer(backend="torch")
  triton  moe.MoELayer(backend="triton")
  cutlass moe.MoELayer(backend="triton") with every GEMM role on torch._grouped_mm
          (KernelConfig.cutlass_roles; the row passes under the interpreter)
  titan-fp8     titan with every grouped GEMM in FP8 (moe.fp8.fp8_grouped_mm, rowwise recipe,
                save_fp8=True: the backward keeps each GEMM's input as e4m3 plus row scales)
  titan-fp8-hp  the same with save_fp8=False (the backward keeps the high-precision inputs)
  fp8     moe.MoELayer(fp8=FP8Config(experts=True)): the "fp8" expert kernel, every expert GEMM
          in e4m3 (save_fp8_inputs=True, the default: the backward keeps the quantized inputs)
  fp8-hp  the same with save_fp8_inputs=False
FP8 on the CPU is moe.fp8's emulation (dequantized float32 operands): its peak includes float32
temporaries a GPU's e4m3 GEMMs do not make; its saved bytes are what the backward keeps.
Columns: bytes saved for backward (saved_tensors_hooks, plus tensors kept on autograd ctx
objects; the input x and the parameters excluded), the peak of live bytes during one fwd+bwd
(the profiler's allocator events: bytes added over the start, weight gradients included), the
weight-gradient bytes, and the bytes moved outside the GEMMs per stage (every non-GEMM aten op's
inputs + outputs, the moe custom ops expanded, the Triton non-GEMM kernels from their shapes).

    PYTHONPATH=. python bench/memory_replay.py            # writes bench/results/<date>-cpu-memory-replay.md

GPU figures derived from this replay are projections, not measurements.
"""

import argparse
import datetime
import os
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHAPES = {  # name: (T, d, E, k, F), the GPU benchmark's shapes
    "Mixtral": (8192, 4096, 8, 2, 14336),
    "OLMoE": (16384, 2048, 64, 8, 1024),
    "Qwen3-30B-A3B": (16384, 2048, 128, 8, 768),
    "DeepSeek-V3 slice": (8192, 7168, 64, 8, 2048),
}
KINDS = ("dense", "titan", "torch", "triton", "cutlass", "titan-fp8", "titan-fp8-hp", "fp8",
         "fp8-hp")  # fmt: skip
LAYER_KINDS = ("torch", "triton", "cutlass", "fp8", "fp8-hp")  # moe.MoELayer
GEMMS = {"mm", "bmm", "addmm", "matmul", "_grouped_mm", "baddbmm", "linear"}
FREE = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "detach",
        "lift_fresh", "_to_copy_noop", "clone_noop"}  # fmt: skip
WRITE_ONLY = {"zeros", "new_zeros", "zeros_like", "full", "new_full", "full_like", "zero_",
              "fill_", "ones", "ones_like", "arange", "randn", "rand"}  # fmt: skip


# ----------------------------------------------------------------------------- counters
def saved_bytes(run, exclude: list[torch.Tensor]):
    """(bytes saved for backward by run(), its output): distinct storages packed by autograd,
    plus tensors kept as attributes of autograd ctx objects, minus those of `exclude`."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def note(t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes():
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())

    def pack(t):
        note(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    stack, visited = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for v in getattr(node, "__dict__", {}).values():
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor):
                    note(t)
        stack.extend(n for n, _ in node.next_functions)
    return sum(seen.values()), out


@contextmanager
def prompt_interpreter_frees():
    """Triton's CPU interpreter leaves every launch's arguments in reference cycles, so their
    storage is freed at the next garbage collection rather than when the last reference goes
    (a compiled launch keeps nothing). Collect after each interpreted launch, so the replay
    frees a buffer where a GPU run frees it."""
    import gc

    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        yield
        return
    launch = GridExecutor.__call__

    def launch_then_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect(0)

    GridExecutor.__call__ = launch_then_collect
    try:
        yield
    finally:
        GridExecutor.__call__ = launch


def peak_live_bytes(step) -> int:
    """Peak over the start of the bytes the CPU allocator holds while step() runs (profiler
    memory events: every allocation and free, in time order; interpreter frees made prompt)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # garbage of earlier steps is not this step's
    with (
        prompt_interpreter_frees(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


class ByteCounter(TorchDispatchMode):
    """Bytes read + written by every non-GEMM aten op (inputs + outputs), per current stage.
    The moe custom ops are expanded (their Python bodies run under the counter)."""

    def __init__(self):
        super().__init__()
        self.stage = "other"
        self.bytes: dict[str, int] = {}
        self.paused = 0  # > 0 inside a Triton launch (the interpreter's own copies)

    def add(self, n: int) -> None:
        if not self.paused:
            self.bytes[self.stage] = self.bytes.get(self.stage, 0) + n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns == "moe":
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS.get(f"moe::{func._opname}")
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        name = func._opname
        if ns != "aten" or name in GEMMS or func.is_view or name in FREE:
            return out
        written = _nbytes(out)
        read = 0 if name in WRITE_ONLY else _nbytes(list(args)) + _nbytes(list(kwargs.values()))
        self.add(read + written)
        return out


@contextmanager
def count_triton_kernels(counter: ByteCounter):
    """The Triton non-GEMM kernels (gather-sum, activation recompute, the CUTLASS roles' row
    passes) by their shapes; zero_tail_rows touches only the dropped rows (none here)."""
    try:
        from moe.kernels.triton import cutlass_roles as cr
        from moe.kernels.triton import expert_mlp as tem
        from moe.kernels.triton import expert_mlp_backward as teb
    except ImportError:
        yield
        return
    names = ("rows_to_tokens", "act_rows", "ragged_mm", "ragged_reduce_mm", "zero_tail_rows")
    patched = [(m, n) for m in (tem, teb) for n in names if hasattr(m, n)]
    patched += [(cr, n) for n in ("act_rows", "act_bwd_rows", "zero_tail_rows")]
    saved = {(m, n): getattr(m, n) for m, n in patched}
    cost = {  # bytes the non-GEMM kernels move; the GEMMs count as GEMM
        "rows_to_tokens": lambda dx, ids, live, T: (
            _nbytes(dx) + T * dx.shape[1] * dx.element_size() + 3 * _nbytes(ids)
        ),
        "act_rows": lambda pre, F_, act, scale, offsets: (
            _nbytes(pre) + pre.shape[0] * F_ * pre.element_size() + _nbytes(scale)
        ),
        "act_bwd_rows": lambda da, pre, act, scale, offsets: (  # read da, pre; write dpre, ds
            _nbytes(da) + 2 * _nbytes(pre) + 2 * _nbytes(scale)
        ),
    }

    def wrapped(module, name):
        def run(*a, **kw):
            if name in cost:
                counter.add(cost[name](*a, **kw))
            counter.paused += 1
            try:
                return saved[(module, name)](*a, **kw)
            finally:
                counter.paused -= 1

        return run

    for m, n in patched:
        setattr(m, n, wrapped(m, n))
    try:
        yield
    finally:
        for m, n in patched:
            setattr(m, n, saved[(m, n)])


def label_backward_stages(out: torch.Tensor, counter: ByteCounter, stage: str, done: set):
    """Nodes reachable from `out` not labelled yet were built by `stage`: their backward is
    counted under 'bwd <stage>' (a pre-hook sets the counter's stage)."""
    stack = [out.grad_fn] if isinstance(out, torch.Tensor) else []
    while stack:
        node = stack.pop()
        if node is None or node in done:
            continue
        done.add(node)

        def hook(grad_outputs, stage=stage):
            counter.stage = f"bwd {stage}"

        node.register_prehook(hook)
        stack.extend(n for n, _ in node.next_functions)


@contextmanager
def stages(layer, counter: ByteCounter):
    """Count a moe.MoELayer's forward per stage (router, dispatch, experts, combine)."""
    done: set = set()
    originals = {}

    def wrap(obj, name, stage):
        fn = getattr(obj, name)
        originals[(obj, name)] = fn

        def run(*a, **kw):
            counter.stage = f"fwd {stage}"
            out = fn(*a, **kw)
            first = out if isinstance(out, torch.Tensor) else None
            if stage == "router":
                first = out.weights_TK if out.weights_TK is not None else out.weights_EC
            elif stage == "dispatch":
                first = out[2].row_weights_R
            label_backward_stages(first, counter, stage, done)
            counter.stage = "other"
            return out

        setattr(obj, name, run)

    wrap(layer.router, "forward", "router")
    wrap(layer.dispatcher, "dispatch", "dispatch")
    wrap(layer.experts, "forward", "experts")
    wrap(layer.dispatcher, "combine", "combine")
    try:
        yield
    finally:
        for (obj, name), _ in originals.items():
            delattr(obj, name)


# ----------------------------------------------------------------------------- layers
class DenseSwiGLU(nn.Module):
    """The dense FFN with the MoE layer's active parameters: d_ff = k * F."""

    def __init__(self, d: int, d_ff: int, dtype):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, d_ff, dtype=dtype) * d**-0.5)
        self.w3 = nn.Parameter(torch.randn(d, d_ff, dtype=dtype) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(d_ff, d, dtype=dtype) * d_ff**-0.5)

    def forward(self, x_TD):
        return (F.silu(x_TD @ self.w1) * (x_TD @ self.w3)) @ self.w2


class TitanStyleMoE(nn.Module):
    """torchtitan's MoE data flow: router linear in x's dtype, fp32 softmax and top-k, argsort
    permute of token rows, grouped GEMMs (autograd saves their inputs), silu(h) * g, scale by
    the scores, scatter_add back to tokens."""

    def __init__(self, d: int, F_: int, E: int, k: int, dtype, fp8_save: bool | None = None):
        super().__init__()
        self.k, self.E, self.fp8_save = k, E, fp8_save  # fp8_save None: bf16 GEMMs
        self.router = nn.Linear(d, E, bias=False, dtype=dtype)
        self.w1 = nn.Parameter(torch.randn(E, d, F_, dtype=dtype) * d**-0.5)
        self.w3 = nn.Parameter(torch.randn(E, d, F_, dtype=dtype) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, F_, d, dtype=dtype) * F_**-0.5)

    def forward(self, x_TD):
        from moe.fp8 import fp8_grouped_mm
        from moe.kernels import grouped_mm_torch as gmm

        if self.fp8_save is not None:  # rowwise FP8 GEMMs, power-of-two scales (torchao's)
            gmm = lambda x, w, o: fp8_grouped_mm(x, w, o, save_fp8=self.fp8_save)  # noqa: E731
        scores_TE = self.router(x_TD).float().softmax(-1)
        top_TK, ids_TK = scores_TE.topk(self.k, -1)
        order_M = torch.argsort(ids_TK.reshape(-1), stable=True)
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=self.E)
        offsets_E = counts_E.cumsum(0).to(torch.int32)
        tok_M = order_M // self.k
        x_MD = x_TD[tok_M]
        h_MF, g_MF = gmm(x_MD, self.w1, offsets_E), gmm(x_MD, self.w3, offsets_E)
        out_MD = gmm(F.silu(h_MF) * g_MF, self.w2, offsets_E)
        out_MD = (out_MD.float() * top_TK.reshape(-1)[order_M, None]).to(x_TD.dtype)
        index_MD = tok_M[:, None].expand(-1, x_TD.shape[1])
        return torch.zeros_like(x_TD).scatter_add(0, index_MD, out_MD)


def build(kind: str, T: int, d: int, E: int, k: int, F_: int, dtype, seed: int = 0):
    """(module, x) of one kind at one shape; MoE layers are dropless SwiGLU."""
    import moe

    torch.manual_seed(seed)
    if kind == "dense":
        module = DenseSwiGLU(d, k * F_, dtype)
    elif kind.startswith("titan"):
        fp8_save = {"titan": None, "titan-fp8": True, "titan-fp8-hp": False}[kind]
        module = TitanStyleMoE(d, F_, E, k, dtype, fp8_save)
    elif kind.startswith("fp8"):
        from moe.fp8 import FP8Config

        fp8 = FP8Config(experts=True, save_fp8_inputs=kind == "fp8")
        module = moe.MoELayer(d, F_, E, top_k=k, capacity_factor=None, activation="swiglu",
                              fp8=fp8).to(dtype)  # fmt: skip
    else:
        backend = "triton" if kind == "cutlass" else kind
        module = moe.MoELayer(d, F_, E, top_k=k, capacity_factor=None, activation="swiglu",
                              backend=backend).to(dtype)  # fmt: skip
    return module, torch.randn(T, d, dtype=dtype, requires_grad=True)


@contextmanager
def gemm_roles_of(kind: str):
    """The kernel config of `kind` while it runs: every GEMM role on CUTLASS for "cutlass", on
    Triton otherwise (whatever moe/kernels/gemm_roles.py's table says)."""
    from moe.kernels import KernelConfig, gemm_roles, set_kernel_config

    set_kernel_config(KernelConfig(cutlass_roles=gemm_roles.ROLES if kind == "cutlass" else ()))
    try:
        yield
    finally:
        set_kernel_config(None)


def measure(kind: str, shape, dtype) -> dict:
    """One kind at one (scaled) shape: saved, peak, grads, non-GEMM bytes per stage."""
    with gemm_roles_of(kind):
        return _measure(kind, shape, dtype)


def _measure(kind: str, shape, dtype) -> dict:
    T, d, E, k, F_ = shape
    module, x = build(kind, T, d, E, k, F_, dtype)
    params = list(module.parameters())
    dy = torch.randn(T, d, dtype=dtype)
    saved, out = saved_bytes(lambda: module(x), [x, *params])
    del out

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(dy)

    step()  # warm-up (autotune, lazy imports)
    module.zero_grad(set_to_none=True)
    x.grad = None
    peak = peak_live_bytes(step)
    grads = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    counter = ByteCounter()
    module.zero_grad(set_to_none=True)
    ctx = stages(module, counter) if kind in LAYER_KINDS else _null()
    with ctx, count_triton_kernels(counter), counter:
        counter.stage = "fwd"
        y = module(x)
        if kind == "dense" or kind.startswith("titan"):
            counter.stage = "bwd"
        y.backward(dy)
    return {"saved": saved, "peak": peak, "grads": grads, "moved": dict(counter.bytes)}


@contextmanager
def _null():
    yield


# ----------------------------------------------------------------------------- report
def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def minimum_moved(T: int, d: int, k: int, dtype) -> int:
    """Bytes outside the GEMMs that one fwd+bwd cannot avoid: x read and y written once, the
    T*k gathered rows once each way, and the same for dy and dx in backward."""
    return 4 * (T * d + T * k * d) * torch.empty((), dtype=dtype).element_size()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=32)
    ap.add_argument(
        "--triton-scale",
        type=int,
        default=None,
        help="scale for the triton kind (the interpreter is slow); default --scale",
    )
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--kinds", nargs="*", default=list(KINDS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows, moved_rows = [], []
    for name in args.shapes:
        T, d, E, k, F_ = SHAPES[name]
        for kind in args.kinds:
            interpreted = kind in ("triton", "cutlass")
            s = args.triton_scale if interpreted and args.triton_scale else args.scale
            r = measure(kind, (T // s, d // s, E, k, F_ // s), dtype)
            f = s * s
            print(name, kind, {k: v for k, v in r.items() if k != "moved"}, flush=True)
            rows.append(f"| {name} | {kind} | {s} | {mib(r['saved'] * f)} | {mib(r['peak'] * f)} | "
                        f"{mib((r['peak'] - r['grads']) * f)} | {mib(r['grads'] * f)} |")  # fmt: skip
            total = sum(r["moved"].values())
            per = ", ".join(f"{st} {mib(b * f)}" for st, b in sorted(r["moved"].items()))
            least = minimum_moved(T, d, k, dtype)  # at the full shape already
            moved_rows.append(f"| {name} | {kind} | {s} | {mib(total * f)} | {mib(least)} | "
                              f"{total * f / least:.1f} | {per} |")  # fmt: skip
    today = datetime.date.today().isoformat()
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"{today}-cpu-memory-replay.md")  # fmt: skip
    lines = [
        f"# Memory replay of one MoE layer fwd+bwd ({today}, CPU, {args.dtype})",
        "",
        f"Command: `PYTHONPATH=. python bench/memory_replay.py {' '.join(argv or sys.argv[1:])}` "
        "on the 2-core CPU machine (Triton kernels under TRITON_INTERPRET=1). Shapes are the "
        "GPU benchmark's (T, d, E, k, F) scaled down `scale`x in T, d and F, run once, and "
        "scaled back by scale^2 (a larger scale overstates the routing metadata more).",
        "**Every MiB figure below is a projection to the full shape, not a GPU measurement.**",
        "",
        "saved = bytes kept for backward (x and parameters excluded); peak = peak live bytes "
        "of one fwd+bwd over the start (weight gradients included); peak - grads = the same "
        "without the weight gradients alive at the end; dense = SwiGLU FFN with d_ff = k*F.",
        "",
        "| shape | layer | scale | saved MiB | peak MiB | peak - grads MiB | grads MiB |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "## Bytes moved outside the GEMMs (one fwd+bwd, MiB, projected)",
        "",
        "Every non-GEMM aten op's inputs + outputs (views excluded; moe custom ops expanded) "
        "plus the Triton non-GEMM kernels (gather-sum to tokens, activation recompute) from "
        "their shapes; GEMM epilogues (activation, its backward, row scaling) count as GEMM. "
        "The minimum is about: read x once, write y once, the gathered rows once each way.",
        "",
        "minimum = one fwd+bwd that reads x once, writes y once and moves the gathered rows "
        "once each way, and the same for dy and dx: 4 * (T*d + T*k*d) elements (the dense "
        "layer's would be 4 * T*d). x min = total / minimum.",
        "",
        "| shape | layer | scale | total | minimum | x min | per stage |",
        "|---|---|---|---|---|---|---|",
        *moved_rows,
        "",
    ]
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
