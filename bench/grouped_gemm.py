"""Grouped-GEMM expert MLP benchmark: the Triton kernels against the alternatives, side by side.

Every method computes the same swiglu expert MLP, out = (silu(x W1_e) * (x W3_e)) W2_e, over the
T*k (token, expert) rows sorted by expert; forward, and forward + backward (all weights and x):
  triton        moe.kernels expert_mlp(kernel="triton"): gather on load, fused swiglu
  dense         one dense MLP over all T*k rows (cuBLAS, same FLOPs): the ceiling
  grouped_mm    torch._grouped_mm (where this torch has it and it runs on the device)
  loop          a Python loop of per-expert matmuls (host-side counts)
  padded_bmm    rows scattered into an [E, max_count, D] buffer, torch.bmm, gathered back
Loads: balanced (every expert gets exactly T*k/E rows) and Zipf-skewed (expert popularity
~ 1/rank**ZIPF_S, k distinct experts per token). TFLOP/s counts useful FLOPs only
(fwd 6*M*D*F, fwd+bwd 3x that; M = T*k), "% dense" is the fraction of the dense ceiling.

  python -m bench.grouped_gemm             # GPU: full shapes; CPU: small shapes, no Triton
  python -m bench.grouped_gemm --small     # small shapes anywhere
Writes bench/results/<date>-<device>-grouped-gemm.md and .png (the report names the device).
"""

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from moe.kernels.expert_mlp import expert_mlp
from moe.kernels.expert_rows import ExpertRows

ZIPF_S = 1.2
FULL_SHAPES = [  # name, E, d_model, d_ff, tokens, k
    ("mixtral", 8, 4096, 14336, 16384, 2),
    ("fine-64", 64, 2048, 1408, 16384, 8),
    ("fine-128", 128, 2048, 768, 16384, 8),
]
SMALL_SHAPES = [
    ("mixtral-small", 8, 256, 896, 256, 2),
    ("fine-64-small", 64, 128, 88, 128, 8),
    ("fine-128-small", 128, 128, 48, 128, 8),
]
METHODS = ("triton", "dense", "grouped_mm", "loop", "padded_bmm")


# ----------------------------------------------------------------------------- routing
def route(T: int, E: int, k: int, load: str, gen: torch.Generator) -> torch.Tensor:
    """expert_TK: k distinct experts per token."""
    if load == "balanced":
        return (torch.arange(T * k).view(T, k)) % E
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** ZIPF_S
    p = p[torch.randperm(E, generator=gen)]
    return torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)


def sort_pairs(expert_TK: torch.Tensor, E: int):
    """(token_ids_M sorted by expert, offsets_E int32, counts list on the host)."""
    T, k = expert_TK.shape
    flat = expert_TK.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    return order // k, counts.cumsum(0).to(torch.int32), counts.tolist()


# ----------------------------------------------------------------------------- methods
def mlp_triton(x, w1, w2, w3, ids, offsets, counts):
    return expert_mlp(
        x,
        offsets,
        w1,
        w2,
        w3,
        activation="swiglu",
        rows=ExpertRows(gather_ids_R=ids),
        kernel="triton",
    )


def mlp_dense(x_MD, w1, w2, w3, ids, offsets, counts):
    """The ceiling: rows already permuted, three dense GEMMs of the same total FLOPs."""
    return (F.silu(x_MD @ w1[0]) * (x_MD @ w3[0])) @ w2[0]


def mlp_grouped_mm(x, w1, w2, w3, ids, offsets, counts):
    x_MD = x.index_select(0, ids)
    h = torch._grouped_mm(x_MD, w1, offs=offsets)
    g = torch._grouped_mm(x_MD, w3, offs=offsets)
    return torch._grouped_mm(F.silu(h) * g, w2, offs=offsets)


def mlp_loop(x, w1, w2, w3, ids, offsets, counts):
    x_MD = x.index_select(0, ids)
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = x_MD[start : start + n]
        outs.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
        start += n
    return torch.cat(outs)


def mlp_padded_bmm(x, w1, w2, w3, ids, offsets, counts):
    E, C = len(counts), max(counts)
    M = ids.shape[0]
    expert_M = torch.repeat_interleave(
        torch.arange(E, device=x.device), torch.tensor(counts, device=x.device)
    )
    starts = torch.cumsum(torch.tensor([0] + counts[:-1], device=x.device), 0)
    slot_M = expert_M * C + torch.arange(M, device=x.device) - starts[expert_M]
    x_ECD = (
        x.new_zeros(E * C, x.shape[1]).index_copy(0, slot_M, x.index_select(0, ids)).view(E, C, -1)
    )
    a = F.silu(torch.bmm(x_ECD, w1)) * torch.bmm(x_ECD, w3)
    return torch.bmm(a, w2).view(E * C, -1).index_select(0, slot_M)


FNS = {"triton": mlp_triton, "dense": mlp_dense, "grouped_mm": mlp_grouped_mm, "loop": mlp_loop,
       "padded_bmm": mlp_padded_bmm}  # fmt: skip


# ----------------------------------------------------------------------------- timing
def timed(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def unavailable(method: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a method cannot run here, or None."""
    if method == "triton" and device.type != "cuda":
        return "n/a (no CUDA)"
    if method == "grouped_mm":
        if not hasattr(torch, "_grouped_mm"):
            return "n/a (torch has no _grouped_mm)"
        if device.type == "cuda" and (
            dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] < 9
        ):
            return "n/a (needs bf16 on sm90+)"
    return None


def bench_one(method, shape, load, args, device, dtype, reps, warmup):
    name, E, D, Fd, T, k = shape
    fn = FNS[method]
    x, w1, w2, w3, ids, offsets, counts = args
    if method == "dense":  # one expert's weights over all M rows: same FLOPs, dense GEMMs
        x, w1, w2, w3 = x.index_select(0, ids), w1[:1], w2[:1], w3[:1]
    params = [t.detach().requires_grad_() for t in (x, w1, w2, w3)]
    dy = torch.randn(ids.shape[0], D, device=device, dtype=dtype)
    fwd = lambda: fn(x, w1, w2, w3, ids, offsets, counts)

    def fwd_bwd():
        out = fn(*params, ids, offsets, counts)
        return torch.autograd.grad(out, params, dy)

    flops = 6.0 * ids.shape[0] * D * Fd
    rows = []
    for pass_name, f, fl in (("fwd", fwd, flops), ("fwd+bwd", fwd_bwd, 3 * flops)):
        try:
            with torch.no_grad() if pass_name == "fwd" else torch.enable_grad():
                t = timed(f, device, reps, warmup)
            rows.append((name, load, pass_name, method, t * 1e3, fl / t / 1e12, None))
        except torch.OutOfMemoryError:
            rows.append((name, load, pass_name, method, None, None, "OOM"))
            torch.cuda.empty_cache()
        except RuntimeError as err:  # e.g. an op this build lacks on this device
            rows.append((name, load, pass_name, method, None, None, f"error: {str(err)[:60]}"))
    return rows


def check_against_loop(args, dtype):
    """Max relative error of the Triton output against the per-expert loop (GPU only)."""
    with torch.no_grad():
        a, b = mlp_triton(*args).float(), mlp_loop(*args).float()
    return ((a - b).abs().max() / b.abs().max()).item()


# ----------------------------------------------------------------------------- report
def device_tag(device: torch.device) -> tuple[str, str]:
    """(file tag, human description)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tag = next(
            (t for t in ("h200", "h100", "a100", "b200", "l40s", "a10") if t in name.lower()), "gpu"
        )
        return tag, f"{name} (CUDA {torch.version.cuda})"
    return (
        "cpu",
        f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
    )


def fmt_table(rows, dense):
    head = f"| {'shape':15s} | {'load':8s} | {'pass':7s} | {'method':10s} | {'time ms':>10s} | {'TFLOP/s':>9s} | {'% dense':>7s} |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for name, load, pass_name, method, ms, tflops, note in rows:
        if note is not None:
            cells = (note, "", "")
        else:
            ceil = dense.get((name, load, pass_name))
            frac = f"{100 * tflops / ceil:.0f}%" if ceil else ""
            cells = (f"{ms:.3f}", f"{tflops:.4g}", frac)
        lines.append(
            f"| {name:15s} | {load:8s} | {pass_name:7s} | {method:10s} | {cells[0]:>10s} | {cells[1]:>9s} | {cells[2]:>7s} |"
        )
    return "\n".join(lines)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r[0], r[1]) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=False)
    width = 0.8 / len(METHODS)
    for ax, pass_name in zip(axes, ("fwd", "fwd+bwd")):
        for i, method in enumerate(METHODS):
            ys = []
            for g in groups:
                hit = [
                    r for r in rows if (r[0], r[1]) == g and r[2] == pass_name and r[3] == method
                ]
                ys.append(hit[0][5] if hit and hit[0][5] is not None else 0.0)
            ax.bar([j + i * width for j in range(len(groups))], ys, width, label=method)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels([f"{n}\n{ld}" for n, ld in groups], fontsize=8)
        ax.set_title(pass_name)
        ax.set_ylabel("TFLOP/s (0 = not run)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="small shapes (the default without CUDA)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument(
        "--reps", type=int, default=None, help="timed repetitions (default 20 GPU, 3 CPU)"
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default=None, help="report path (.md); the plot goes beside it (.png)")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    small = a.small or device.type != "cuda"
    shapes = SMALL_SHAPES if small else FULL_SHAPES
    reps, warmup = (a.reps or 20, 3) if device.type == "cuda" else (a.reps or 3, 1)
    methods = [m for m in a.methods.split(",") if m]
    tag, desc = device_tag(device)
    print(f"device measured: {desc}")
    print(
        f"torch {torch.__version__}, dtype {a.dtype}, {'small' if small else 'full'} shapes, swiglu, reps {reps}"
    )

    rows, checks = [], []
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        name, E, D, Fd, T, k = shape
        for load in ("balanced", "zipf"):
            ids, offsets, counts = sort_pairs(route(T, E, k, load, gen), E)
            rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(
                device=device, dtype=dtype
            )
            args = (rnd(T, D), rnd(E, D, Fd, scale=D**-0.5), rnd(E, Fd, D, scale=Fd**-0.5),
                    rnd(E, D, Fd, scale=D**-0.5), ids.to(device), offsets.to(device), counts)  # fmt: skip
            print(
                f"{name} {load}: E={E} d_model={D} d_ff={Fd} T={T} k={k} rows/expert min {min(counts)} max {max(counts)}"
            )
            for method in methods:
                why = unavailable(method, device, dtype)
                if why is not None:
                    rows += [(name, load, ps, method, None, None, why) for ps in ("fwd", "fwd+bwd")]
                    continue
                rows += bench_one(method, shape, load, args, device, dtype, reps, warmup)
            if device.type == "cuda" and "triton" in methods:
                checks.append(
                    f"{name} {load}: max rel. error triton vs loop {check_against_loop(args, dtype):.2e}"
                )
            del args
            if device.type == "cuda":
                torch.cuda.empty_cache()

    dense = {(r[0], r[1], r[2]): r[5] for r in rows if r[3] == "dense" and r[5]}
    table = fmt_table(rows, dense)
    print(table)
    for c in checks:
        print(c)

    today = datetime.date.today().isoformat()
    out = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"{today}-{tag}-grouped-gemm.md"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    png = os.path.splitext(out)[0] + ".png"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    notes = [
        f"# Grouped-GEMM expert MLP benchmark, {today}",
        "",
        f"- Device measured: **{desc}**",
        f"- torch {torch.__version__}, triton {triton_version}, dtype {a.dtype}, swiglu expert MLP "
        f"(3 GEMMs), {'small' if small else 'full'} shapes, median of {reps} runs after {warmup} warm-up",
        f"- Zipf exponent {ZIPF_S}; balanced = exactly T*k/E rows per expert",
        "- TFLOP/s counts useful FLOPs (fwd 6*M*D*F, fwd+bwd 18*M*D*F, M = T*k); % dense = "
        "fraction of the dense ceiling (one dense MLP over the same M rows)",
    ]
    if device.type != "cuda":
        notes.append("- **No GPU was lent for this run**: the Triton column is n/a and the CPU "
                     "figures only show the harness runs end to end. GPU figures are still owed.")  # fmt: skip
    notes += ["", table, ""] + [f"- {c}" for c in checks]
    if not a.no_plot:
        plot(rows, png, f"{desc}, {a.dtype}")
        notes += ["", f"![TFLOP/s]({os.path.basename(png)})"]
    with open(out, "w") as f:
        f.write("\n".join(notes) + "\n")
    print(f"wrote {out}" + ("" if a.no_plot else f" and {png}"))


if __name__ == "__main__":
    main()
