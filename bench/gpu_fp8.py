"""FP8 rows of the GPU check (issue 40, issue 43): at the four shapes, side by side in one run,
the up-projection grouped GEMM [T*k, d] x [E, d, F] forward + backward in bf16
(moe.kernels.torch_grouped_mm, i.e. torch._grouped_mm) against FP8 (moe.fp8.fp8_grouped_mm,
rowwise recipe: torch._scaled_grouped_mm on sm_90+, the emulation elsewhere): median ms, peak
MiB, and the SQNR (dB) of y, dx and dw against float32 on the same operands; then the whole
layer (moe.MoELayer, SwiGLU, dropless, one process) in bf16 against FP8 (FP8Config(dispatch=True,
experts=True): the dispatch's quantization emulated in one process, every expert GEMM in e4m3)
against the bf16 layer on moe's torch kernel (torch._grouped_mm, like the FP8 kernel's GEMMs; the
Triton layer is stage c's, and its compiles would not fit this stage): ms, peak, and the SQNR of
y and dx against the float32 layer with the same (bf16-rounded) weights.

    python -m bench.gpu_fp8 --shapes all --json rows.json      # on the GPU (scripts/gpu_check.sh)
    python -m bench.gpu_fp8 --shapes deepseek --profile         # + kernel tables, time outside GEMMs
    python -m bench.gpu_fp8 --smoke-cpu --shapes 64/32/4/2/48   # the plumbing on CPU, no timings

Records have bench/gpu_layer.py's form (shape, T, d, E, k, F, candidate, figure, value, unit).
Without CUDA (and without --smoke-cpu) it prints one line and exits 2: nothing measured.
"""

import argparse
import json
import statistics
import sys
import time
from functools import partial

import torch

from bench import gpu_profile
from bench.titan_style import parse_shapes
from moe.fp8 import fp8_grouped_mm
from moe.kernels.torch_grouped_mm import grouped_mm_torch

NO_CUDA_EXIT = 2
SMOKE_MAX_ROWS_D_F = 2**22  # --smoke-cpu: the emulation on 2 cores, a few seconds per shape
CANDIDATES = {"gemm bf16": grouped_mm_torch, "gemm fp8 rowwise": fp8_grouped_mm}


def sqnr_db(a: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |a - ref|^2), in float64."""
    ref = ref.double()
    noise = (a.double() - ref).pow(2).sum().clamp_min(1e-300)
    return (10 * torch.log10(ref.pow(2).sum() / noise)).item()


def inputs(s, device: str, seed: int = 0):
    """x [T*k, d], w [E, d, F], dy [T*k, F] in float32 and random routing offsets (int32)."""
    g = torch.Generator().manual_seed(seed)
    M = s.T * s.k
    x = torch.randn(M, s.d, generator=g)
    w = torch.randn(s.E, s.d, s.F, generator=g) / s.d**0.5
    dy = torch.randn(M, s.F, generator=g)
    counts = torch.bincount(torch.randint(0, s.E, (M,), generator=g), minlength=s.E)
    offsets = counts.cumsum(0).to(torch.int32)
    return [t.to(device) for t in (x, w, dy, offsets)]


def fwd_bwd(fn, x, w, dy, offsets):
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(xg, wg, offsets)
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad


def timed_ms(step, iters: int, warmup: int, cuda: bool) -> float | None:
    """Median ms per step (CUDA events); None on CPU (nothing is timed in a smoke run)."""
    if not cuda:
        step()
        return None
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profiled(s, name: str, step, cuda: bool, records: list) -> None:
    """The kernel table of 3 steps (printed) and the split of their device time into GEMM
    kernels and the rest (recorded): where an FP8 step's time goes."""
    steps = 3 if cuda else 1
    averages = gpu_profile.profile_steps(step, steps, cuda)
    print(f"### {s.name}, {name}, {steps} fwd+bwd steps\n\n```\n"
          f"{gpu_profile.kernel_table(averages, cuda, rows=12)}\n```\n")  # fmt: skip
    for figure, value in gpu_profile.gemm_split(averages, steps, cuda).items():
        records.append({"shape": s.name, "T": s.T, "d": s.d, "E": s.E, "k": s.k, "F": s.F,
                        "candidate": name, "figure": figure, "value": round(value, 3),
                        "unit": "count" if figure.startswith("kernels") else "ms"})  # fmt: skip


def measure_shape(s, args, cuda: bool, records: list) -> None:
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    x, w, dy, offsets = inputs(s, dev)
    ref = fwd_bwd(grouped_mm_torch, x, w, dy, offsets)  # float32 on the same operands
    x, w, dy = x.to(dtype), w.to(dtype), dy.to(dtype)
    shape = {"shape": s.name, "T": s.T, "d": s.d, "E": s.E, "k": s.k, "F": s.F}

    def rec(candidate, figure, value, unit):
        records.append({**shape, "candidate": candidate, "figure": figure, "value": value,
                        "unit": unit})  # fmt: skip

    for name, fn in CANDIDATES.items():
        got = fwd_bwd(fn, x, w, dy, offsets)
        for label, a, b in zip(("y", "dx", "dw"), got, ref):
            rec(name, f"sqnr_{label}_db", round(sqnr_db(a, b), 2), "dB")
        del got
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = timed_ms(lambda fn=fn: fwd_bwd(fn, x, w, dy, offsets), args.iters, args.warmup, cuda)
        rec(name, "fwd_bwd_ms", None if ms is None else round(ms, 3), "ms")
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
        rec(name, "peak_above_inputs_mib", None if peak is None else round(peak, 1), "MiB")
        if args.profile_shape == s.name and "fp8" in name:
            profiled(s, name, lambda fn=fn: fwd_bwd(fn, x, w, dy, offsets), cuda, records)


def layer_step(layer, x, dy):
    xg = x.detach().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    layer.zero_grad(set_to_none=True)
    return y.detach(), xg.grad


def measure_layer(s, args, cuda: bool, records: list) -> None:
    """bf16 MoELayer against the FP8 one (same weights), each against float32."""
    import moe
    from moe.fp8 import FP8Config

    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    kw = dict(top_k=s.k, capacity_factor=None, activation="swiglu", device=dev)
    ref = moe.MoELayer(s.d, s.F, s.E, **kw).to(dtype).float()  # bf16-rounded weights
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s.T, s.d, generator=g).to(dev)
    dy = torch.randn(s.T, s.d, generator=g).to(dev)
    want = layer_step(ref, x, dy)
    shape = {"shape": s.name, "T": s.T, "d": s.d, "E": s.E, "k": s.k, "F": s.F}
    variants = {"layer bf16 (torch kernel)": ("torch", None),
                "layer fp8 dispatch+experts": ("auto", FP8Config(dispatch=True, experts=True))}  # fmt: skip
    for name, (backend, fp8) in variants.items():
        layer = moe.MoELayer(s.d, s.F, s.E, **kw, dtype=dtype, backend=backend, fp8=fp8)
        layer.load_state_dict(ref.state_dict())
        xd, dyd = x.to(dtype), dy.to(dtype)
        got = layer_step(layer, xd, dyd)
        for label, a, b in zip(("y", "dx"), got, want):
            records.append({**shape, "candidate": name, "figure": f"sqnr_{label}_db",
                            "value": round(sqnr_db(a, b), 2), "unit": "dB"})  # fmt: skip
        del got
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = timed_ms(partial(layer_step, layer, xd, dyd), args.iters, args.warmup, cuda)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
        if args.profile_shape == s.name:
            profiled(s, name, partial(layer_step, layer, xd, dyd), cuda, records)
        for figure, value, unit in (("fwd_bwd_ms", ms, "ms"), ("peak_above_inputs_mib", peak,
                                                               "MiB")):  # fmt: skip
            value = None if value is None else round(value, 3)
            records.append({**shape, "candidate": name, "figure": figure, "value": value,
                            "unit": unit})  # fmt: skip


def report(records: list, device: str) -> str:
    lines = [f"## FP8 against bf16: up-projection grouped GEMM and the layer, fwd+bwd, on {device}",
             "", "| shape | candidate | fwd+bwd ms | peak MiB | SQNR y / dx / dw dB |",
             "|---|---|---|---|---|"]  # fmt: skip
    by = {}
    for r in records:
        by.setdefault((r["shape"], r["candidate"]), {})[r["figure"]] = r["value"]
    for (shape, cand), f in by.items():
        if "failed" in f:
            lines.append(f"| {shape} | {cand} | failed: {f['failed']} | | |")
            continue
        sq = " / ".join(str(f.get(f"sqnr_{k}_db")) for k in ("y", "dx", "dw"))
        lines.append(f"| {shape} | {cand} | {f.get('fwd_bwd_ms')} | "
                     f"{f.get('peak_above_inputs_mib')} | {sq} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="all", help="presets or T/d/E/k/F, comma-separated")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=30.0, help="past this, skip the "
                   "remaining shapes (their rows say so)")  # fmt: skip
    p.add_argument("--smoke-cpu", action="store_true", help="CPU, float32, nothing timed")
    p.add_argument("--no-layer", action="store_true", help="the grouped GEMM rows only")
    p.add_argument("--json", help="write the records to this file")
    p.add_argument("--profile", action="store_true", help="kernel tables of the FP8 GEMM and of "
                   "both layers at the first shape, and their time outside the GEMMs")  # fmt: skip
    args = p.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))
    args.profile_shape = shapes[0].name if args.profile and shapes else None
    big = [s.name for s in shapes if s.T * s.k * s.d * s.F > SMOKE_MAX_ROWS_D_F]
    if args.smoke_cpu and big:
        p.error(f"--smoke-cpu: shapes with T*k*d*F <= {SMOKE_MAX_ROWS_D_F} only; too big: "
                f"{', '.join(big)}")  # fmt: skip
    cuda = not args.smoke_cpu
    if cuda and not torch.cuda.is_available():
        print("bench/gpu_fp8.py: no CUDA device here; nothing measured (exit 2)")
        return NO_CUDA_EXIT
    device = (
        torch.cuda.get_device_name() if cuda else "CPU (smoke run: float32 for bf16, nothing timed)"
    )
    records: list[dict] = []
    t0, failed = time.monotonic(), 0
    for s in shapes:
        shape = {"shape": s.name, "T": s.T, "d": s.d, "E": s.E, "k": s.k, "F": s.F}
        if time.monotonic() - t0 > args.max_seconds:
            records.append({**shape, "candidate": "fp8 rows", "figure": "skipped",
                            "value": f"past --max-seconds {args.max_seconds:g}", "unit": ""})  # fmt: skip
            continue
        try:
            measure_shape(s, args, cuda, records)
            if not args.no_layer:
                measure_layer(s, args, cuda, records)
        except Exception as e:  # noqa: BLE001 - one shape's failure is a row, the rest run
            failed += 1
            records.append({**shape, "candidate": "fp8 rows", "figure": "failed",
                            "value": f"{type(e).__name__}: {e}"[:300], "unit": ""})  # fmt: skip
        if cuda:
            torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "records": records}, f)
    print(report(records, device))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
