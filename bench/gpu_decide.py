"""The decision rules of issue 35, written before the GPU run, applied to the check's records.

1. TMA: the TMA path becomes the default on sm_90 if it passed stage b (correctness) and its
   fwd+bwd is faster than the pointer path's at TMA_MIN_SHAPES of the four shapes.
2. GEMM roles: each role goes to CUTLASS (torch._grouped_mm) at a shape class where the role
   table shows CUTLASS faster by more than moe.kernels.gemm_roles.CUTLASS_MARGIN at every
   measured shape of the class, to the Triton kernel elsewhere. The CUTLASS figure is the role
   as moe runs it there (GEMM + row passes, bench/gpu_roles.py's "cutlass"), not the GEMM
   alone; the Triton figure is the TMA variant's when rule 1 makes TMA the default. A move to
   CUTLASS also needs stage b's pointer selection passed (it holds tests/test_cutlass_roles.py,
   every role on CUTLASS against float64). The "moe triton CUTLASS roles" layer row is
   reported beside "moe triton" per shape as the layer-level check.
3. M6: the GPU preset keeps its batch and width if it reaches M6_MIN_SPEEDUP x the 2-core CPU's
   tokens/s; otherwise the report names the bound: host syncs (more than M6_MAX_SYNCS per step),
   else kernel launches (the step is host-bound: bench/m6_step_ops counts its operators).
4. FP8 (issue 61): at each shape of stage f, the fastest FP8 layer row against the fastest bf16
   layer row (fwd+bwd ms, the weights' e4m3 forms made in the step as after every optimizer
   step); the goal FP8_GOAL x at FP8_GOAL_SHAPES, stretch FP8_STRETCH x. Each layer row's
   time is also held to bench.budget's floor: within FLOOR_MAX_RATIO x, else named.
"""

from moe.kernels import gemm_roles

TMA_MIN_SHAPES = 3  # of the 4 shapes (issue 35)
M6_MIN_SPEEDUP = 5.0  # GPU preset tokens/s over the 2-core CPU preset's (issue 35)
M6_MAX_SYNCS = 1.0  # host syncs per training step (issue 35's goal)
FP8_GOAL, FP8_STRETCH = 1.0, 1.2  # FP8 layer speed over bf16's (issue 61)
FP8_GOAL_SHAPES = ("DeepSeek-V3 slice", "Mixtral")
FLOOR_MAX_RATIO = 2.0  # measured ms over the budget's floor ms (issue 61)


def _figures(records: list[dict], figure: str) -> dict[tuple[str, str], float]:
    """(shape, candidate) -> value of `figure`, measured values only."""
    return {
        (r["shape"], r["candidate"]): r["value"]
        for r in records
        if r["figure"] == figure and isinstance(r.get("value"), (int, float))
    }


def tma_decision(records: list[dict], tma_tests_passed: bool | None) -> tuple[bool, str]:
    """(make TMA the sm_90 default, why)."""
    ms = _figures(records, "fwd_bwd_ms")
    shapes = sorted({s for s, c in ms if c == "moe triton TMA" and (s, "moe triton") in ms})
    faster = [s for s in shapes if ms[(s, "moe triton TMA")] < ms[(s, "moe triton")]]
    why = f"TMA faster than pointer at {len(faster)} of {len(shapes)} measured shapes"
    why += f" ({', '.join(faster) or 'none'}); needs {TMA_MIN_SHAPES}"
    if not tma_tests_passed:
        state = "not run" if tma_tests_passed is None else "failed"
        return False, f"TMA correctness (stage b) {state}; {why}"
    return len(faster) >= TMA_MIN_SHAPES, why + "; stage b passed"


def role_decision(
    records: list[dict], roles_tests_passed: bool | None = True, tma: bool = False
) -> tuple[dict[tuple[str, str], str], list[str]]:
    """(the (role, shape class) -> backend table the measurements give, one line per change).
    Without the CUDA tests of the CUTLASS roles passed, no role moves to CUTLASS. With `tma`
    (the TMA default adopted) the Triton figure is the role's TMA variant where measured."""
    ms = {}
    for r in records:
        if r["figure"] == "ms" and r["candidate"].startswith("role ") and r["value"] is not None:
            parts = r["candidate"].split(" ")  # "role up triton", "role up TMA triton"
            role, backend = (parts[1], parts[2]) if len(parts) == 3 else (None, None)
            if parts[2:] == ["TMA", "triton"]:
                role, backend = parts[1], "triton TMA"
            if role in gemm_roles.ROLES:
                cls = gemm_roles.shape_class(r["d"], r["F"])
                ms.setdefault((role, cls), {}).setdefault(r["shape"], {})[backend] = r["value"]
    for by_shape in ms.values():  # the Triton figure: the TMA variant's once TMA is the default
        for v in by_shape.values():
            if tma and "triton TMA" in v:
                v["triton"] = v["triton TMA"]
    table, lines = dict(gemm_roles.TABLE), []
    for key, by_shape in sorted(ms.items()):
        both = [v for v in by_shape.values() if "triton" in v and "cutlass" in v]
        if not both:
            continue
        wins = all(v["cutlass"] * (1 + gemm_roles.CUTLASS_MARGIN) < v["triton"] for v in both)
        ratios = ", ".join(f"{s}: triton/cutlass {v['triton'] / v['cutlass']:.2f}"
                           for s, v in by_shape.items() if "triton" in v and "cutlass" in v)  # fmt: skip
        if wins and not roles_tests_passed:
            state = "not run" if roles_tests_passed is None else "failed"
            lines.append(f"{key[0]} at {key[1]}: CUTLASS faster ({ratios}) but the CUDA tests "
                         f"of the CUTLASS roles (stage b) {state}: stays {table[key]}")  # fmt: skip
            continue
        table[key] = "cutlass" if wins else "triton"
        if table[key] != gemm_roles.TABLE[key]:
            lines.append(
                f"{key[0]} at {key[1]}: {gemm_roles.TABLE[key]} -> {table[key]} ({ratios})"
            )
    return table, lines


def cutlass_layer_rows(records: list[dict]) -> list[str]:
    """Per shape: fwd+bwd of the layer with every role on CUTLASS over "moe triton"'s."""
    ms = _figures(records, "fwd_bwd_ms")
    return [
        f"{s}: every role on CUTLASS {ms[(s, 'moe triton CUTLASS roles')]:.2f} ms vs "
        f"{ms[(s, 'moe triton')]:.2f} ms"
        for s in sorted({s for s, _ in ms})
        if (s, "moe triton") in ms and (s, "moe triton CUTLASS roles") in ms
    ]


def m6_decision(gpu_tok_s: float | None, cpu_tok_s: float | None, syncs_per_step: float | None):
    """(keep the preset's batch and width, why)."""
    if not gpu_tok_s or not cpu_tok_s:
        return False, "not measured"
    speedup = gpu_tok_s / cpu_tok_s
    why = f"{gpu_tok_s:,.0f} tokens/s = {speedup:.1f}x the CPU's {cpu_tok_s:,.0f} (needs {M6_MIN_SPEEDUP:g}x)"
    if speedup >= M6_MIN_SPEEDUP:
        return True, why
    if syncs_per_step is not None and syncs_per_step > M6_MAX_SYNCS:
        return False, f"{why}; bound: host syncs ({syncs_per_step:.1f} per step)"
    return (
        False,
        f"{why}; bound: kernel launches (host-bound step; syncs per step {syncs_per_step})",
    )


def fp8_speedups(records: list[dict], figure: str = "fwd_bwd_ms") -> dict:
    """Per shape of stage f's layer rows: (the fastest bf16 row, its fwd_bwd_ms, {FP8 row: that
    ms over the FP8 row's `figure`}); a speed-up above 1 is FP8 faster."""
    ms, fp8_ms = _figures(records, "fwd_bwd_ms"), _figures(records, figure)
    out = {}
    for shape in dict.fromkeys(s for s, _ in ms):
        bf16 = {c: v for (s, c), v in ms.items() if s == shape and c.startswith("layer bf16")}
        fp8 = {c: v for (s, c), v in fp8_ms.items() if s == shape and c.startswith("layer fp8")}
        bf16, fp8 = ({c: v for c, v in d.items() if v > 0} for d in (bf16, fp8))
        if bf16 and fp8:
            base = min(bf16, key=bf16.get)
            out[shape] = (base, bf16[base], {c: bf16[base] / v for c, v in fp8.items()})
    return out


def fp8_decision(records: list[dict]) -> list[str]:
    """One line per shape: the fastest FP8 row's speed-up over the fastest bf16 row, the goal's
    verdict at the goal shapes, every FP8 row's speed-up (with the weights' forms reused)."""
    made, cached = fp8_speedups(records), fp8_speedups(records, "fwd_bwd_ms_cached")
    goal = f"goal >= {FP8_GOAL:g}x, stretch {FP8_STRETCH:g}x"
    lines = []
    for shape in dict.fromkeys((*FP8_GOAL_SHAPES, *made)):
        if shape not in made:
            lines.append(f"FP8 vs bf16 layer at {shape}: not measured ({goal})")
            continue
        base, base_ms, by = made[shape]
        best = max(by, key=by.get)
        verdict = "no goal at this shape"
        if shape in FP8_GOAL_SHAPES:
            verdict = "meets the stretch" if by[best] >= FP8_STRETCH else (
                "meets the goal" if by[best] >= FP8_GOAL else "misses the goal")  # fmt: skip
            verdict += f" ({goal})"
        reused = cached.get(shape, (None, None, {}))[2]
        rows = "; ".join(
            f"{c.removeprefix('layer ')} {v:.2f}x"
            + (f" (forms reused {reused[c]:.2f}x)" if c in reused else "")
            for c, v in by.items()
        )
        lines.append(f"FP8 vs bf16 layer at {shape}: {best.removeprefix('layer ')} {by[best]:.2f}x "
                     f"{base.removeprefix('layer ')} ({base_ms:.2f} ms): {verdict}; {rows}")  # fmt: skip
    return lines


def floor_decision(records: list[dict]) -> str:
    """How many measured layer rows are within FLOOR_MAX_RATIO x bench.budget's floor; the
    others named."""
    ratios = _figures(records, "measured_over_floor")
    if not ratios:
        return "Budget floors (bench.budget) beside the layer rows: not measured"
    over = [f"{s} {c.removeprefix('layer ')} {r:.2f}x" for (s, c), r in ratios.items()
            if r > FLOOR_MAX_RATIO]  # fmt: skip
    return (f"Budget floors (bench.budget, micro-batch 1): {len(ratios) - len(over)} of "
            f"{len(ratios)} layer rows within {FLOOR_MAX_RATIO:g}x of the floor"
            + (f"; over it: {', '.join(over)}" if over else ""))  # fmt: skip
