"""One MoE FFN layer (SwiGLU experts, bf16, dropless) forward + backward on one CUDA GPU, side
by side in one run: a dense SwiGLU FFN of equal active FLOPs (width k*F), a torchtitan-style
layer (bench/titan_style.py), DeepSpeed-MoE (capacity 1.0) and Tutel (capacity 0) when they
import, and moe.MoELayer with backend="triton" and "torch", eager and torch.compile'd, and
backend="triton" with the opt-in TMA path ("moe triton TMA": KernelConfig(tma=True) while it runs)
and with every GEMM role on CUTLASS ("moe triton CUTLASS roles": KernelConfig.cutlass_roles).

    python -m bench.gpu_layer                       # the four shapes, everything (target < 5 min
                                                    # on one H100, not yet measured; --max-minutes)
    python -m bench.gpu_layer --quick               # no compile, no peers, fewer iterations
    python -m bench.gpu_layer --shapes mixtral,512/256/8/2/384 --iters 20
    python -m bench.gpu_layer --profile             # + time outside the GEMMs per candidate and
                                                    # one kernel table (moe triton, first shape)
    python -m bench.gpu_layer --smoke-cpu --shapes 64/32/4/2/48   # the plumbing on CPU (Triton's
                                                    # interpreter, pinned configs; nothing timed)

Per candidate: median fwd+bwd ms from CUDA events after warm-up, expert TFLOP/s, peak MiB
(torch.cuda.max_memory_allocated over one step, only that candidate resident), and the
norm-relative error of y, dx, dW1 against a float32 moe layer with the same (bf16-rounded)
weights and routing. Then the GEMM-role table (bench/gpu_roles.py): every grouped GEMM role
timed alone, moe's Triton kernel vs CUTLASS (torch._grouped_mm).
Writes bench/results/<date>-<gpu>-gpu-layer.md, or $OUT/gpu-layer.md when $OUT is set, and with
--json PATH one record per measured figure. Without CUDA it prints one line and exits with
status 2 (nothing was measured); --smoke-cpu exits 1 when any candidate or role failed.
"""

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import moe
from bench import gpu_profile
from bench.gpu_roles import role_table
from bench.titan_style import SwiGLU, TitanStyleMoE, expert_flops, parse_shapes
from moe.kernels import KernelConfig, gemm_roles, set_kernel_config

NO_CUDA_EXIT = 2
# --smoke-cpu runs the Triton kernels in Triton's interpreter, whose time grows with T*k*d*F:
# 64/32/4/2/48 (196,608) takes ~16 s per Triton candidate on the loaded 2-core machine, the
# issue's 256/128/8/2/192 (64x that) did not finish in 15 minutes.
SMOKE_MAX_WORK = 2**18
DEV = "cuda"  # --smoke-cpu: "cpu", to test this script's plumbing without a GPU (no timings)


def cuda_time(fn, iters: int, warmup: int) -> float:
    """Median ms of fn() from CUDA events, after `warmup` calls."""
    if DEV == "cpu":  # --smoke-cpu: one call (plumbing only: the interpreter is slow), no timing
        fn()
        return float("nan")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


PROFILES: list[str] = []  # kernel tables for the report
RECORDS: list[dict] = []  # one per measured figure (--json)


def record(s, candidate: str, figure: str, value, unit: str) -> None:
    if isinstance(value, float) and value != value:  # NaN: nothing measured (smoke run)
        value = None
    shape = {"shape": s.name, "T": s.T, "d": s.d, "E": s.E, "k": s.k, "F": s.F}
    RECORDS.append(
        {**shape, "candidate": candidate, "figure": figure, "value": value, "unit": unit}
    )


JSON_PATH: list[str] = []  # --json: rewritten after every candidate (a killed run keeps them)


def write_json(device: str, argv) -> None:
    for path in JSON_PATH:
        with open(path, "w") as f:
            json.dump({"device": device, "argv": list(argv), "records": RECORDS}, f)


def profile_candidate(s, name: str, step) -> str:
    """Time outside the GEMMs per step (recorded); the kernel table once, for moe triton at the
    first shape profiled (the Mixtral shape in the full run)."""
    cuda = DEV == "cuda"
    steps = 3 if cuda else 1
    averages = gpu_profile.profile_steps(step, steps, cuda)
    split = gpu_profile.gemm_split(averages, steps, cuda)
    for figure, value in split.items():
        record(s, name, figure, value, "count" if figure.startswith("kernels") else "ms")
    if name == "moe triton" and not PROFILES:
        table = gpu_profile.kernel_table(averages, cuda)
        PROFILES.append(f"### {s.name}, {name}, {steps} fwd+bwd steps\n\n```\n{table}\n```\n")
    return f"{split['outside_gemm_ms']:.2f}"


def _empty_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def rel_err(a: torch.Tensor | None, ref: torch.Tensor | None) -> str:
    if a is None or ref is None:
        return "–"
    a, ref = a.detach().float().cpu(), ref.float()
    return f"{((a - ref).norm() / ref.norm().clamp_min(1e-30)).item():.1e}"


def moe_layer(s, backend: str, dtype):
    torch.manual_seed(0)
    return moe.MoELayer(s.d, s.F, s.E, top_k=s.k, capacity_factor=None, activation="swiglu",
                        backend=backend, device=DEV, dtype=dtype)  # fmt: skip


def _init_dist() -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if DEV == "cuda" else "gloo", rank=0, world_size=1)


class _First(torch.nn.Module):
    """Keep y of layers that return (y, aux, ...); [T, d] in and out."""

    def __init__(self, layer, batch_dim: bool):
        super().__init__()
        self.layer, self.batch_dim = layer, batch_dim

    def forward(self, x):
        y = self.layer(x.unsqueeze(0) if self.batch_dim else x)
        y = y[0] if isinstance(y, tuple) else y
        return y.squeeze(0) if self.batch_dim else y


def deepspeed_layer(s, dtype):
    from deepspeed.moe.layer import MoE

    _init_dist()
    torch.manual_seed(0)
    layer = MoE(s.d, SwiGLU(s.d, s.F, device=DEV, dtype=dtype), num_experts=s.E, ep_size=1, k=s.k, capacity_factor=1.0,
                eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True, use_rts=False)  # fmt: skip
    return _First(layer, batch_dim=True).to(DEV, dtype)


def tutel_layer(s, dtype):
    from tutel import moe as tutel_moe

    _init_dist()
    torch.manual_seed(0)
    layer = tutel_moe.moe_layer(
        gate_type={"type": "top", "k": s.k, "capacity_factor": 0},
        model_dim=s.d,
        experts={"type": "ffn", "count_per_node": s.E, "hidden_size_per_expert": s.F,
                 "activation_fn": lambda x: torch.nn.functional.silu(x)},
    )  # fmt: skip
    return _First(layer, batch_dim=False).to(DEV, dtype)


def candidates(s, args, dtype, state):
    """name -> (builder, shares moe's weights and routing); peers that do not import: notes."""
    c = {
        "dense": (lambda: SwiGLU(s.d, s.k * s.F, device=DEV, dtype=dtype), False),
        "titan-style": (lambda: titan(s, dtype, state), True),
        "moe triton": (lambda: moe_layer(s, "triton", dtype), True),
        "moe torch": (lambda: moe_layer(s, "torch", dtype), True),
        # the opt-in TMA path (KernelConfig(tma=True) while this candidate runs)
        "moe triton TMA": (lambda: moe_layer(s, "triton", dtype), True),
        # every GEMM role on torch._grouped_mm (KernelConfig.cutlass_roles while it runs): the
        # layer-level check of what the role table would pick
        "moe triton CUTLASS roles": (lambda: moe_layer(s, "triton", dtype), True),
    }
    if not args.no_compile:
        for name in ("moe triton", "moe torch"):
            build, shares = c[name]
            c[name + " compiled"] = (lambda b=build: torch.compile(b()), shares)
    notes = []
    if not args.no_peers:
        for name, module, build in (
            ("DeepSpeed cf1.0", "deepspeed", deepspeed_layer),
            ("Tutel cf0", "tutel", tutel_layer),
        ):
            try:
                __import__(module)
                c[name] = (lambda b=build: b(s, dtype), False)
            except Exception as e:  # noqa: BLE001 - the report says why
                notes.append(f"{name} not run: `import {module}` failed ({type(e).__name__}: {e})")
    return c, notes


def titan(s, dtype, state):
    layer = moe_layer(s, "torch", dtype)
    layer.load_state_dict(state)
    return TitanStyleMoE(layer.router, s.E, s.d, s.F, device=DEV, dtype=dtype).load_from_moe(layer)


def reference(s, x_TD, dy_TD, state):
    """y, dx, dW1 of a float32 moe layer with the candidates' (bf16-rounded) weights."""
    ref = moe_layer(s, "torch", torch.float32)
    ref.load_state_dict(state)
    x = x_TD.float().requires_grad_()
    y = ref(x)
    y.backward(dy_TD.float())
    out = (y.detach().cpu(), x.grad.cpu(), ref.experts.w1.grad.cpu())
    del ref, x, y
    return out


def run_candidate(name, build, shares, s, x_TD, dy_TD, state, ref, args):
    _empty_cache()
    t0, ms = time.perf_counter(), None
    roles = gemm_roles.ROLES if "CUTLASS" in name else None
    set_kernel_config(KernelConfig(tma="TMA" in name, cutlass_roles=roles))  # for this candidate
    try:
        module = build()
        if shares and "titan" not in name:  # titan-style loads it when built
            (getattr(module, "_orig_mod", module)).load_state_dict(state)
        x = x_TD.detach().clone().requires_grad_()

        def step():
            module.zero_grad(set_to_none=True)
            x.grad = None
            module(x).backward(dy_TD)
            return module

        if DEV == "cuda":  # compile / autotune before the timed warm-up
            step()
        ms = cuda_time(step, args.iters, args.warmup)
        module.zero_grad(set_to_none=True)
        on_gpu = DEV == "cuda"
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        x.grad = None
        y = module(x)
        y.backward(dy_TD)
        peak = torch.cuda.max_memory_allocated() / 2**20 if on_gpu else float("nan")
        errs = ["–"] * 3
        if shares:
            w1 = getattr(module, "_orig_mod", module)
            w1 = w1.experts.w1 if hasattr(w1, "experts") else w1.w1
            errs = [rel_err(y, ref[0]), rel_err(x.grad, ref[1]), rel_err(w1.grad, ref[2])]
        outside = "–"
        profiled = name == "moe triton" or DEV == "cuda" and name != "dense"
        if args.profile and profiled and "compiled" not in name:  # smoke: one (interpreter)
            outside = profile_candidate(s, name, step)
        tflops = expert_flops(s) / ms / 1e9
        record(s, name, "fwd_bwd_ms", ms, "ms")
        record(s, name, "peak_mib", peak, "MiB")
        for figure, err in zip(("err_y", "err_dx", "err_dw1"), errs):
            if err != "–":
                record(s, name, figure, float(err), "relative")
        row = (
            f"| {s.name} | {name} | {ms:.2f} | {tflops:.0f} | {peak:.0f} | "
            + " | ".join(errs)
            + f" | {outside} |"
        )
    except torch.cuda.OutOfMemoryError:
        ms = None
        record(s, name, "failed", "OOM", "")
        row = f"| {s.name} | {name} | OOM | | | | | |"
    except Exception as e:  # noqa: BLE001 - one failing candidate must not end the run
        ms = None
        msg = str(e).splitlines()[0][:100] if str(e) else ""
        record(s, name, "failed", f"{type(e).__name__}: {msg}", "")
        row = f"| {s.name} | {name} | failed: {type(e).__name__}: {msg} | | | | | |"
    finally:
        set_kernel_config(None)
        module = x = y = None  # noqa: F841
        gc.collect()
        _empty_cache()
    return row + f" {time.perf_counter() - t0:.0f} s |", ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="all", help="presets (mixtral, olmoe, qwen3, deepseek, "
                   "all) or T/d/E/k/F, comma-separated")  # fmt: skip
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="no compile, no peers, 5 iterations")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile moe triton (and TMA) per shape: top kernels in the report",
    )
    p.add_argument("--max-minutes", type=float, default=4.5, help="past this, skip the remaining "
                   "compiled candidates, peers and the every-role-on-CUTLASS layer (their rows "
                   "say so); the role table runs per shape")  # fmt: skip
    p.add_argument("--only", default="", help="comma-separated candidate names to run")
    p.add_argument("--no-roles", action="store_true", help="skip the GEMM-role table")
    p.add_argument("--smoke-cpu", action="store_true", help="tests only: run every candidate on "
                   "CPU (float32, no timings, no compile; peers on gloo if they import; Triton's interpreter with "
                   "pinned configs) to check the script")  # fmt: skip
    p.add_argument("--json", help="also write one record per measured figure to this file")
    args = p.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)  # bad --shapes: an error before anything runs
    except ValueError as e:
        p.error(str(e))
    big = [s.name for s in shapes if s.T * s.k * s.d * s.F > SMOKE_MAX_WORK]
    if args.smoke_cpu and big:
        p.error(f"--smoke-cpu runs Triton's interpreter: shapes with T*k*d*F <= {SMOKE_MAX_WORK} "
                f"only (e.g. 32/16/4/2/16); too big: {', '.join(big)}")  # fmt: skip
    global DEV
    DEV = "cpu" if args.smoke_cpu else "cuda"
    if not args.smoke_cpu and not torch.cuda.is_available():
        print("bench/gpu_layer.py: no CUDA device here; nothing measured (exit 2)")
        return NO_CUDA_EXIT
    if args.quick:
        args.no_compile = args.no_peers = True
        args.iters, args.warmup = min(args.iters, 5), min(args.warmup, 2)
    if args.smoke_cpu:  # peers run when they import (the rehearsal's carried DeepSpeed)
        args.no_compile = True
        # the kernels in Triton's interpreter, one pinned config each: autotuning there runs
        # every config many times (minutes per kernel); set before any kernel module loads
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MOE_TRITON_AUTOTUNE"] = "0"
    PROFILES.clear()
    RECORDS.clear()
    JSON_PATH[:] = [args.json] if args.json else []
    dtype = torch.float32 if args.smoke_cpu else torch.bfloat16
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (smoke run, nothing timed)"
    pinned = os.environ.get("MOE_TRITON_AUTOTUNE", "1") == "0"
    configs = "pinned (MOE_TRITON_AUTOTUNE=0)" if pinned else "autotuned"
    lines = [
        f"# MoE layer fwd+bwd on {gpu} "
        f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Run by `python -m bench.gpu_layer {' '.join(argv or sys.argv[1:])}`; "
        f"torch {torch.__version__}, triton {__import__('triton').__version__}, bf16, SwiGLU, "
        f"dropless (DeepSpeed: capacity 1.0, drops). Median of {args.iters} CUDA-event timings "
        f"after {args.warmup} warm-up steps; Triton configs {configs}. TFLOP/s counts the expert GEMMs (18*T*k*d*F). "
        "Errors: ||a - ref|| / ||ref|| against a float32 moe layer with the same weights.",
        "",
    ]
    rows, notes, role_rows = [], [], []
    t_start = time.perf_counter()
    for s in shapes:
        g = torch.Generator(device=DEV).manual_seed(1)
        x_TD = torch.randn(s.T, s.d, device=DEV, dtype=dtype, generator=g)
        dy_TD = torch.randn(s.T, s.d, device=DEV, dtype=dtype, generator=g)
        state = {
            k: v.detach().clone() for k, v in moe_layer(s, "torch", dtype).state_dict().items()
        }
        ref = reference(s, x_TD, dy_TD, state)
        cands, shape_notes = candidates(s, args, dtype, state)
        if args.only:
            keep = {n.strip() for n in args.only.split(",")}
            cands = {n: c for n, c in cands.items() if n in keep}
        notes += [n for n in shape_notes if n not in notes]
        times = {}
        for name, (build, shares) in cands.items():
            optional = (
                name.endswith("compiled") or "CUTLASS" in name or not shares and name != "dense"
            )
            if optional and time.perf_counter() - t_start > 60 * args.max_minutes:
                rows.append(f"| {s.name} | {name} | skipped: over --max-minutes | | | | | | | |")
                record(s, name, "skipped", "over --max-minutes", "")
                continue
            row, ms = run_candidate(name, build, shares, s, x_TD, dy_TD, state, ref, args)
            rows.append(row)
            times[name] = ms
            print(row, flush=True)
            write_json(gpu, argv or sys.argv[1:])
        dense = times.get("dense")
        best = min((v for k, v in times.items() if k.startswith("moe") and v), default=None)
        if dense and best:
            notes.append(f"{s.name}: best moe / dense = {best / dense:.2f}")
        del ref, state, x_TD, dy_TD
        if not args.no_roles:  # per shape: a run stopped later keeps these in the JSON
            time_fn = lambda fn: cuda_time(fn, args.iters, args.warmup)  # noqa: E731
            table = role_table(s, time_fn, DEV, dtype, records=RECORDS)
            role_rows += table
            print("\n".join(table), flush=True)
            write_json(gpu, argv or sys.argv[1:])
    head = (
        "| shape | candidate | fwd+bwd ms | TFLOP/s | peak MiB | err y | err dx | err dW1 | "
        "outside GEMMs ms | wall |"
    )
    lines += [head, "|---|---|---|---|---|---|---|---|---|---|", *rows, "", *notes, ""]
    if PROFILES:
        lines += ["## Profiles (3 fwd+bwd steps, kernels by self device time)", "", *PROFILES]
    if not args.no_roles:
        lines += [
            "## GEMM roles alone: moe Triton vs CUTLASS (torch._grouped_mm)",
            "",
            "CUTLASS as moe runs it: the GEMM plus the epilogue's work as row passes "
            "(moe/kernels/triton/cutlass_roles.py; the decision rule's figure); GEMM alone: "
            "on pre-permuted rows, no epilogue (a lower bound).",
            "",
            "| shape | role | triton ms | triton TFLOP/s | CUTLASS ms | CUTLASS TFLOP/s | "
            "% of CUTLASS | CUTLASS GEMM alone ms | GEMM alone TFLOP/s |",
            "|---|---|---|---|---|---|---|---|---|",
            *role_rows,
        ]
    lines.append(f"Total wall time: {time.perf_counter() - t_start:.0f} s.")
    text = "\n".join(lines) + "\n"
    write_json(gpu, argv or sys.argv[1:])
    if dist.is_initialized():
        dist.destroy_process_group()
    out_dir = os.environ.get("OUT")
    if args.smoke_cpu:
        print(text)
        failed = [r for r in RECORDS if r["figure"] == "failed"]
        for r in failed:
            print(f"smoke run: {r['shape']} {r['candidate']} failed: {r['value']}")
        if out_dir:  # the rehearsal: the report file too (nothing timed in it)
            with open(os.path.join(out_dir, "gpu-layer.md"), "w") as f:
                f.write(text)
        return 1 if failed else 0
    if out_dir:
        path = os.path.join(out_dir, "gpu-layer.md")
    else:
        tag = torch.cuda.get_device_name().split()[-1].lower()
        name = f"{datetime.date.today().isoformat()}-{tag}-gpu-layer.md"
        path = os.path.join(os.path.dirname(__file__), "results", name)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
