"""FP8 rows of the GPU check (issues 40, 43, 61): at the four shapes, side by side in one run.

At each shape the layer rows run first, then the GEMM rows: the up-projection grouped GEMM
[T*k, d] x [E, d, F] forward + backward in bf16 (moe.kernels.torch_grouped_mm, i.e.
torch._grouped_mm) against FP8 (moe.fp8.fp8_grouped_mm, rowwise recipe): median ms, peak MiB,
and the SQNR (dB) of y, dx and dw against float32 on the same operands.

Layer rows: one moe.MoELayer (SwiGLU, dropless, one process) per bench.budget variant, built
with that variant's options, in this order (LAYERS; a row not started by --max-seconds is
recorded as skipped): bf16 torch (torch._grouped_mm, like the FP8 kernel's GEMMs), FP8 rowwise
and blockwise with FP8 dispatch (emulated in one process), then without it, then bf16 triton
(last: in the GPU check, stage c compiled its kernels at these shapes just before; alone, its
first compile may not fit stage f's limit). Figures of each row: the SQNR of y and dx against
the float32 layer with the same (bf16-rounded) weights; fwd_bwd_ms, the median of steps that
each make the expert weights' e4m3 forms (moe.fp8.weights_changed() first, as after every
optimizer step: bench.budget's micro-batch 1); fwd_bwd_ms_cached (FP8 rows: the forms reused,
as micro-batches 2+); peak MiB; floor_ms_<GPU>, bench.budget's lower bound for the variant and
shape on this GPU (bytes at the HBM bandwidth or GEMM FLOPs at the peak), counted in this
process on the CUDA stand-in (~0.1-0.5 s a row); measured_over_floor (flagged above
bench.gpu_decide.FLOOR_MAX_RATIO); speedup_vs_bf16 (FP8 rows: the fastest bf16 row's ms over
the row's).

    python -m bench.gpu_fp8 --shapes all --json rows.json      # on the GPU (scripts/gpu_check.sh)
    python -m bench.gpu_fp8 --shapes deepseek --profile         # + kernel tables, time outside GEMMs
    python -m bench.gpu_fp8 --smoke-cpu --shapes 32/16/4/2/16   # the plumbing on CPU, no timings

Records have bench/gpu_layer.py's form (shape, T, d, E, k, F, candidate, figure, value, unit).
Without CUDA (and without --smoke-cpu) it prints one line and exits 2: nothing measured.
"""

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

import torch

from bench import gpu_decide, gpu_profile
from bench.titan_style import parse_shapes
from moe.fp8 import fp8_grouped_mm, weights_changed
from moe.kernels.torch_grouped_mm import grouped_mm_torch

NO_CUDA_EXIT = 2
SMOKE_MAX_ROWS_D_F = 2**16  # --smoke-cpu: Triton's interpreter (bf16 triton), seconds a shape
CANDIDATES = {"gemm bf16": grouped_mm_torch, "gemm fp8 rowwise": fp8_grouped_mm}
# the layer rows, in the order they run: bench.budget.VARIANTS names
LAYERS = ("bf16 torch", "fp8 rowwise +dispatch", "fp8 blockwise +dispatch", "fp8 rowwise",
          "fp8 blockwise", "bf16 triton")  # fmt: skip
PROFILED = ("bf16 torch", "fp8 rowwise +dispatch", "fp8 blockwise +dispatch")  # --profile
SMOKE_GPU = "H100"  # --smoke-cpu: whose floors the plumbing computes (nothing is timed)


def gpu_kind(name: str) -> str | None:
    """bench.budget's GPU (its HBM bandwidth) for a torch.cuda.get_device_name(), or None:
    SXM parts only (an H100 PCIe has 2.0 TB/s, an NVL 3.9)."""
    if "H200" in name:
        return "H200"
    return "H100" if "H100" in name and ("HBM3" in name or "SXM" in name) else None


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


def peak_timed(step, args, cuda: bool) -> tuple:
    """(median ms, peak MiB above what was allocated before) of step()."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ms = timed_ms(step, args.iters, args.warmup, cuda)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return ms, peak


def recorder(records: list, s, candidate: str):
    def rec(figure, value, unit=""):
        if isinstance(value, float):
            value = float(f"{value:.4g}")
        records.append({"shape": s.name, "T": s.T, "d": s.d, "E": s.E, "k": s.k, "F": s.F,
                        "candidate": candidate, "figure": figure, "value": value, "unit": unit})  # fmt: skip

    return rec


def profiled(s, name: str, step, cuda: bool, rec) -> None:
    """The kernel table of 3 steps (printed) and the split of their device time into GEMM
    kernels and the rest (recorded): where an FP8 step's time goes."""
    steps = 3 if cuda else 1
    averages = gpu_profile.profile_steps(step, steps, cuda)
    print(f"### {s.name}, {name}, {steps} fwd+bwd steps\n\n```\n"
          f"{gpu_profile.kernel_table(averages, cuda, rows=12)}\n```\n")  # fmt: skip
    for figure, value in gpu_profile.gemm_split(averages, steps, cuda).items():
        rec(figure, value, "count" if figure.startswith("kernels") else "ms")


def measure_gemms(s, args, cuda: bool, records: list) -> None:
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    x, w, dy, offsets = inputs(s, dev)
    ref = fwd_bwd(grouped_mm_torch, x, w, dy, offsets)  # float32 on the same operands
    x, w, dy = x.to(dtype), w.to(dtype), dy.to(dtype)
    for name, fn in CANDIDATES.items():
        rec = recorder(records, s, name)
        got = fwd_bwd(fn, x, w, dy, offsets)
        for label, a, b in zip(("y", "dx", "dw"), got, ref):
            rec(f"sqnr_{label}_db", round(sqnr_db(a, b), 2), "dB")
        del got
        step = fresh(partial(fwd_bwd, fn, x, w, dy, offsets))
        ms, peak = peak_timed(step, args, cuda)
        rec("fwd_bwd_ms", ms, "ms")
        rec("peak_above_inputs_mib", peak, "MiB")
        if args.profile_shape == s.name and "fp8" in name:
            profiled(s, name, step, cuda, rec)
    weights_changed()  # the cached forms hold w's storage


def fresh(step):
    """step() with the weights' e4m3 forms made again in it (moe.fp8.weights_changed() first),
    as after every optimizer step; a no-op for bf16."""

    def run():
        weights_changed()
        return step()

    return run


def layer_step(layer, x, dy):
    xg = x.detach().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    layer.zero_grad(set_to_none=True)
    return y.detach(), xg.grad


def measure_layers(s, args, cuda: bool, gpu, floors: dict, records: list, late, save) -> None:
    """Every LAYERS row at shape s, each against the float32 layer and beside its floor
    (floors[variant]); save() after each row."""
    import moe

    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    kw = dict(top_k=s.k, capacity_factor=None, activation="swiglu", device=dev)
    ref = moe.MoELayer(s.d, s.F, s.E, **kw).to(dtype).float()  # bf16-rounded weights
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s.T, s.d, generator=g).to(dev)
    dy = torch.randn(s.T, s.d, generator=g).to(dev)
    want = layer_step(ref, x, dy)
    xd, dyd = x.to(dtype), dy.to(dtype)
    for variant in LAYERS:
        rec = recorder(records, s, f"layer {variant}")
        floor = floors[variant]
        unit = "ms" if isinstance(floor, float) else ""
        rec(f"floor_ms_{gpu}" if gpu else "floor_ms", floor, unit)
        if late():
            rec("skipped", f"past --max-seconds {args.max_seconds:g}")
            continue
        try:
            layer = moe.MoELayer(s.d, s.F, s.E, **kw, dtype=dtype, **variant_options(variant))
            layer.load_state_dict(ref.state_dict())
            ms = layer_row(s, variant, layer, xd, dyd, want, args, cuda, rec)
            rec("measured_over_floor", ms / floor if ms and isinstance(floor, float) else None, "x")
        except Exception as e:  # noqa: BLE001 - one row's failure (an OOM) is a row, the rest run
            rec("failed", f"{type(e).__name__}: {e}"[:300])
        layer = None  # freed with its grads before the next row is built, and its e4m3 forms
        weights_changed()  # (the cache holds them and the weights' storage: ~11 GB at DeepSeek)
        if cuda:
            torch.cuda.empty_cache()
        save()
    here = gpu_decide.fp8_speedups([r for r in records if r["shape"] == s.name]).get(s.name)
    base, _, by = here or ("no bf16 row timed", None, {})
    for variant in LAYERS:
        name = f"layer {variant}"
        done = {r["figure"] for r in records if r["shape"] == s.name and r["candidate"] == name}
        if "fp8" in variant and "fwd_bwd_ms" in done:  # None in a smoke run: nothing timed
            recorder(records, s, name)("speedup_vs_bf16", by.get(name), f"x vs {base}")


def variant_options(variant: str) -> dict:
    """moe.MoELayer's options of a bench.budget variant (the one place they are named)."""
    from bench import budget

    opts = budget.VARIANTS[variant]
    return dict(opts() if callable(opts) else opts)


def layer_row(s, variant: str, layer, x, dy, want, args, cuda: bool, rec) -> float | None:
    """SQNR, ms (the weights' forms made in each step; FP8: also reused), peak; the ms."""
    for label, a, b in zip(("y", "dx"), layer_step(layer, x, dy), want):
        rec(f"sqnr_{label}_db", round(sqnr_db(a, b), 2), "dB")
    step = fresh(partial(layer_step, layer, x, dy))
    ms, peak = peak_timed(step, args, cuda)
    rec("fwd_bwd_ms", ms, "ms")
    if "fp8" in variant:  # the forms reused, as by micro-batches 2+ of a step
        reused = timed_ms(partial(layer_step, layer, x, dy), args.iters, 1, cuda)
        rec("fwd_bwd_ms_cached", reused, "ms")
    rec("peak_above_inputs_mib", peak, "MiB")
    if args.profile_shape == s.name and variant in PROFILED:
        profiled(s, f"layer {variant}", step, cuda, rec)
    return ms


def floor_ms(variant: str, s, gpu: str | None):
    """bench.budget's floor (ms) of one fwd+bwd of `variant` at s on `gpu`, or why none (the
    row is measured either way)."""
    if gpu is None:
        return f"no floor: {torch.cuda.get_device_name()} is not an H100 SXM or H200"
    from bench import budget

    try:
        return budget.measure(variant, s).floor_ms(gpu)
    except Exception as e:  # noqa: BLE001 - the stand-in on this torch: the report says why
        return f"not counted: {type(e).__name__}: {e}"[:300]


def _cell(f: dict, figure: str) -> str:
    v = f.get(figure)
    return "" if v is None else str(v)


def report(records: list, device: str, gpu: str | None) -> str:
    by = {}
    for r in records:
        by.setdefault((r["shape"], r["candidate"]), {})[r["figure"]] = r["value"]
    floor = f"floor_ms_{gpu}" if gpu else "floor_ms"
    lines = [f"## FP8 against bf16, fwd+bwd, on {device}", "",
             "| shape | candidate | fwd+bwd ms | forms reused ms | peak MiB | SQNR y / dx / dw dB | "
             f"{floor} | measured / floor | speed-up vs bf16 |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (shape, cand), f in by.items():
        for bad in ("failed", "skipped"):
            if bad in f:
                lines.append(
                    f"| {shape} | {cand} | {bad}: {f[bad]} | | | | {_cell(f, floor)} | | |"
                )
        if "failed" in f or "skipped" in f:
            continue
        sq = " / ".join(str(f[k]) for k in ("sqnr_y_db", "sqnr_dx_db", "sqnr_dw_db") if k in f)
        ratio = f.get("measured_over_floor")
        flag = (
            f" (> {gpu_decide.FLOOR_MAX_RATIO:g}x)"
            if ratio and ratio > gpu_decide.FLOOR_MAX_RATIO
            else ""
        )
        lines.append(f"| {shape} | {cand} | {_cell(f, 'fwd_bwd_ms')} | {_cell(f, 'fwd_bwd_ms_cached')} | "
                     f"{_cell(f, 'peak_above_inputs_mib')} | {sq} | {_cell(f, floor)} | "
                     f"{_cell(f, 'measured_over_floor')}{flag} | {_cell(f, 'speedup_vs_bf16')} |")  # fmt: skip
    decisions = [*gpu_decide.fp8_decision(records), gpu_decide.floor_decision(records)]
    return "\n".join([*lines, "", *[f"- {d}" for d in decisions]]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="all", help="presets or T/d/E/k/F, comma-separated")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=300.0, help="past this, start no new row "
                   "(the rows not started say so)")  # fmt: skip
    p.add_argument("--smoke-cpu", action="store_true", help="CPU, float32, nothing timed")
    p.add_argument("--no-layer", action="store_true", help="the grouped GEMM rows only")
    p.add_argument("--json", help="write the records to this file (after every row)")
    p.add_argument("--profile", action="store_true", help="kernel tables of the FP8 GEMM and of "
                   f"the layers {', '.join(PROFILED)} at the first shape, and their time outside "
                   "the GEMMs")  # fmt: skip
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
    if args.smoke_cpu:  # bf16 triton's kernels in Triton's interpreter, before any loads
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MOE_TRITON_AUTOTUNE"] = "0"
        device, gpu = (
            f"CPU (smoke run: float32 for bf16, nothing timed, {SMOKE_GPU} floors)",
            SMOKE_GPU,
        )
    else:
        device = torch.cuda.get_device_name()
        gpu = gpu_kind(device)
    records: list[dict] = []
    t0, failed = time.monotonic(), 0

    def late() -> bool:
        return time.monotonic() - t0 > args.max_seconds

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "gpu": gpu, "records": records}, f)

    # every floor first (~0.1 s each): beside the rows skipped for time too
    floors = (
        {} if args.no_layer else {(s.name, v): floor_ms(v, s, gpu) for s in shapes for v in LAYERS}
    )
    for s in shapes:
        if late():
            recorder(records, s, "fp8 rows")("skipped", f"past --max-seconds {args.max_seconds:g}")
            continue
        try:  # the layer rows first: the FP8 goal's figures
            if not args.no_layer:
                here = {v: floors[(s.name, v)] for v in LAYERS}
                measure_layers(s, args, cuda, gpu, here, records, late, save)
            if late():
                recorder(records, s, "gemm rows")(
                    "skipped", f"past --max-seconds {args.max_seconds:g}"
                )
            else:
                measure_gemms(s, args, cuda, records)
        except Exception as e:  # noqa: BLE001 - one shape's failure is a row, the rest run
            recorder(records, s, "fp8 rows")("failed", f"{type(e).__name__}: {e}"[:300])
        failed += sum(r["figure"] == "failed" for r in records if r["shape"] == s.name)
        if cuda:
            torch.cuda.empty_cache()
        save()
    print(report(records, device, gpu))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
