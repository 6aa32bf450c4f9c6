"""Every pass around the expert GEMMs of the bf16 fine-grained path, named (issue 61 item 4).

    python -m bench.budget_passes                          # OLMoE and Qwen3-30B-A3B, Triton + CUTLASS
    python -m bench.budget_passes --shapes tiny --variants "bf16 triton"
    python -m bench.budget_passes --out bench/results/2026-12-07-budget-passes.md

bench.budget's count of one layer step (micro-batch 1's fwd+bwd on the CUDA stand-in), with
each launch attributed to the code that issued it (the innermost frame in moe/; launches with
none are autograd's own or the benchmark's) and grouped into the passes of PASSES: what each
is, its bytes outside the GEMMs and launches, and whether the fusions of SonicMoE (arXiv
2512.14080: gather in the up-projection's operand load, SwiGLU and its backward in GEMM
epilogues, the combine as a gather-and-sum, tile-aligned token counts) remove it. GEMM
launches are one row ("the GEMMs", their bytes apart). A launch no rule names is reported as
"unnamed: <op> at <file>:<function>" (tests/test_budget_passes.py keeps there none).
"""

import argparse
import dataclasses
import json
import sys
import traceback
from collections import defaultdict

import torch

from bench import budget
from bench.budget_count import GEMMS, TRITON_GEMMS, Counter, _base
from bench.titan_style import parse_shapes

VARIANTS = ("bf16 triton", "bf16 cutlass")
SHAPES = "olmoe,qwen3"

# key -> (what the pass does, what SonicMoE-style fusion does with it, moe's status)
PASSES = {
    "gemm": ("the GEMMs (router and experts; bytes apart)", "-", "-"),
    "router upcast": (
        "router: x upcast to float32 chunk by chunk (fwd, dw) and dx cast back",
        "not SonicMoE's (router); one fused float32 matmul would remove it",
        "kept (no float32 copy of x alive); chunks at most 4 on a GPU (were 4 MiB: 32 at Mixtral)",
    ),
    "routing": (
        "routing: softmax, top-k, normalisation, aux and z losses, stats, finite check (fwd+bwd)",
        "kept (outside the expert path)",
        "kept",
    ),
    "row map": (
        "row map: stable sort of the T k pairs by expert, counts, offsets, row weights",
        "kept (SonicMoE sorts too)",
        "kept",
    ),
    "x grad sum": (
        "x gradient: the router's and the experts' parts added (autograd)",
        "kept (two consumers of x)",
        "kept",
    ),
    "harness": ("the benchmark's own y * 1 and its backward", "-", "not the layer's"),
    "gather x": (
        "x gathered into expert rows (R d copy)",
        "removed: the gather is fused into the up GEMM's operand load",
        "Triton: fused (gather on load); CUTLASS: a copy (torch._grouped_mm has no gather)",
    ),
    "gather x wgrad": (
        "x gathered again for dW1 / dW3 (R d copy)",
        "removed: gathered in the weight-gradient GEMM's load",
        "kept on purpose: a gathered A in the reduction loop drains Triton's pipeline "
        "(grouped_mm_wgrad.py); the copy keeps the loads contiguous",
    ),
    "gather dy": (
        "dy gathered into expert rows for the backward (R d copy)",
        "removed: gathered in the dact GEMM's load",
        "kept: dW2 reads the same rows (its gathered load would be the pre-permute copy again)",
    ),
    "act": (
        "activation: s * act(h, g) from the up GEMM's output",
        "removed: SwiGLU in the up GEMM's epilogue",
        "Triton: in the epilogue; CUTLASS: one row pass (no epilogue)",
    ),
    "act recompute": (
        "activation recomputed for dW2: s * act(pre) from the saved pre-activation",
        "removed: the dSwiGLU epilogue writes it",
        "removed here: the dact epilogue (Triton) or the activation-backward pass (CUTLASS) "
        "writes it",
    ),
    "act bwd": (
        "activation backward: dpre = act'(pre) s da, ds = <da, act> (and s act(pre) for dW2)",
        "removed: dSwiGLU in the dact GEMM's epilogue",
        "Triton: in the epilogue; CUTLASS: one row pass",
    ),
    "row weight grad": (
        "combine weights' gradient: per-16-column partials summed (and their buffer)",
        "kept (SonicMoE reduces ds too)",
        "zero fill removed here; the sum kept (no atomics)",
    ),
    "h g copy": (
        "CUTLASS up: h and g copied into one [h, g] buffer",
        "removed (one GEMM writes both)",
        "kept on CUTLASS (torch._grouped_mm writes a fresh tensor)",
    ),
    "dx add": (
        "CUTLASS dx: dh w1^T and dg w3^T added",
        "removed (one GEMM over [dh, dg])",
        "Triton: one GEMM, two K loops; CUTLASS: kept",
    ),
    "tail zero": (
        "rows past the live count zeroed (dropped pairs)",
        "removed (token rounding: no tail)",
        "a no-op for dropless rows (the kernel returns at once; counted at its arguments)",
    ),
    "wgrad order": (
        "experts ordered busiest first for the weight-gradient grid",
        "-",
        "kept: 5 tiny launches on E ints, once per backward (was once per weight-gradient GEMM)",
    ),
    "combine map": (
        "the sum into tokens' inverse map: each token's rows (was: sort + searchsorted, fwd and "
        "bwd)",
        "removed: the gather-and-sum reads the pairs' rows",
        "removed here: the row map's pair rows, sorted once per step (ExpertRows.token_rows_TK)",
    ),
    "combine": (
        "combine: each token's k rows summed (fwd), dx rows summed into tokens (bwd)",
        "kept: SonicMoE's gather-and-sum (no scatter-add)",
        "kept: gather-and-sum, fp32, no atomics",
    ),
}

# (path in moe/, function or "*", op or "*") -> pass key; first match wins
RULES = [
    ("gating/base.py", "*", "*", "router upcast"),
    ("gating/", "*", "*", "routing"),
    ("layer.py", "_canonical_counts", "*", "row map"),
    ("layer.py", "*", "*", "routing"),
    ("capacity.py", "*", "*", "row map"),
    ("dispatch/", "*", "*", "row map"),
    ("kernels/triton/gather_sum.py", "rows_to_tokens", "triton _gather_sum_kernel", "combine"),
    ("kernels/triton/gather_sum.py", "*", "*", "combine map"),
    ("kernels/triton/combine.py", "*", "*", "combine"),
    ("kernels/triton/expert_mlp.py", "_backward", "index_select", "gather dy"),
    ("kernels/triton/grouped_mm_wgrad.py", "ragged_reduce_mm", "index_select", "gather x wgrad"),
    ("kernels/triton/grouped_mm_wgrad.py", "busiest_first", "*", "wgrad order"),
    ("kernels/triton/expert_mlp_backward.py", "backward_act", "*", "row weight grad"),
    ("kernels/triton/cutlass_roles.py", "_rows", "*", "gather x"),
    ("kernels/triton/cutlass_roles.py", "up", "copy_", "h g copy"),
    ("kernels/triton/cutlass_roles.py", "dx", "add_", "dx add"),
    ("kernels/triton/activations.py", "act_rows", "*", "act"),
    ("kernels/triton/row_passes.py", "act_bwd_rows", "*", "act bwd"),
    ("kernels/triton/row_passes.py", "zero_tail_blocks", "*", "tail zero"),
    ("kernels/torch_grouped_mm.py", "zero_tail_rows", "*", "tail zero"),
    (None, "*", "mul", "harness"),  # no frame in moe/: the benchmark's y * 1 and its grad
    (None, "*", "add", "x grad sum"),
    (None, "*", "*", "routing"),  # autograd's own: the routing ops' backward
]


def _site() -> tuple[str, str] | None:
    """(path under moe/, function) of the innermost moe/ frame issuing the launch."""
    for f in reversed(traceback.extract_stack()):
        if "/moe/" in f.filename:
            return f.filename.split("/moe/")[-1], f.name
    return None


def classify(site: tuple[str, str] | None, op: str, backward: bool) -> str:
    """The pass key of one launch (its site and op); the activation recompute is the
    act_rows launch of the backward."""
    for path, fn, rule_op, key in RULES:
        if path is None and site is not None:
            continue
        if path is not None and (site is None or not site[0].startswith(path)):
            continue
        if fn != "*" and site[1] != fn:
            continue
        if rule_op != "*" and op != rule_op:
            continue
        return "act recompute" if key == "act" and backward else key
    return f"unnamed: {op} at {site[0]}:{site[1]}" if site else f"unnamed: {op}"


@dataclasses.dataclass
class Pass:
    launches: int = 0
    bytes: int = 0


class PassCounter(Counter):
    """bench.budget_count.Counter that also sums launches and bytes per pass (micro-batch 1)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: dict[str, Pass] = defaultdict(Pass)

    def _record(self, op: str, before: tuple[int, int], gemm: bool) -> None:
        p = self.now
        if not self.enabled or self.phase != "first" or p.launches == before[0]:
            return
        backward = torch._C._current_graph_task_id() != -1  # run by the autograd engine
        key = "gemm" if gemm else classify(_site(), op, backward)
        self.passes[key].launches += p.launches - before[0]
        self.passes[key].bytes += p.bytes_outside - before[1]

    def on_op(self, func, args, kwargs, out, depth):
        before = (self.now.launches, self.now.bytes_outside)
        super().on_op(func, args, kwargs, out, depth)
        self._record(_base(func), before, _base(func) in GEMMS)

    def on_triton(self, name, grid, args, kwargs):
        before = (self.now.launches, self.now.bytes_outside)
        super().on_triton(name, grid, args, kwargs)
        self._record(f"triton {name}", before, name in TRITON_GEMMS)


def measure(variant: str, shape) -> dict[str, Pass]:
    """The passes of micro-batch 1's fwd+bwd of `variant` at `shape` (bench.budget.measure's
    step, one micro-batch)."""
    made = []

    def counter(*args, **kwargs):
        made.append(PassCounter(*args, **kwargs))
        return made[-1]

    saved, budget.Counter = budget.Counter, counter
    try:
        budget.measure(variant, shape, 1)
    finally:
        budget.Counter = saved
    return dict(made[0].passes)


def _cell(p: Pass | None) -> str:
    return "-" if p is None else f"{p.bytes / 1e6:,.1f} / {p.launches}"


def table(results: dict, before: dict | None = None) -> str:
    """results: {(shape name, variant): {key: Pass}} -> one markdown row per pass; with
    `before` (the same, counted on an older tree) each cell reads "before -> now"."""
    cols = list(results)
    head = ["pass"] + [f"{s}, {v}: MB / launches" for s, v in cols] + ["SonicMoE", "moe"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    every = [*results.values(), *(before or {}).values()]
    keys = [k for k in PASSES if any(k in r for r in every)]
    keys += sorted({k for r in every for k in r if k not in PASSES})
    for k in keys + ["total"]:
        what, sonic, status = PASSES.get(k, (k, "?", "?"))
        if k == "total":
            what, sonic, status = "**total**", "", ""
        cells = []
        for c in cols:
            now = [results[c]] + ([before[c]] if before and c in before else [])
            got = [_total(r) if k == "total" else r.get(k) for r in now]
            cells.append(" -> ".join(map(_cell, got[::-1])))
        lines.append("| " + " | ".join([what, *cells, sonic, status]) + " |")
    return "\n".join(lines)


def _total(r: dict[str, Pass]) -> Pass:
    return Pass(sum(p.launches for p in r.values()), sum(p.bytes for p in r.values()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="bench.titan_style.parse_shapes, or 'tiny'")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None, help="write the counts here (for a later --before)")
    ap.add_argument("--before", default=None, help="--json of an older tree: before -> now")
    ap.add_argument("--out", default=None, help="append the markdown table to this file")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    shapes = [budget.TINY] if args.shapes == "tiny" else parse_shapes(args.shapes)
    results = {
        (s.name, v): measure(v, s) for s in shapes for v in args.variants.split(",")
    }  # fmt: skip
    before = None
    if args.before:
        with open(args.before) as f:
            before = {tuple(c.split("|")): {k: Pass(*p) for k, p in r.items()}
                      for c, r in json.load(f).items()}  # fmt: skip
    text = table(results, before)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            counts = {"|".join(c): {k: [p.launches, p.bytes] for k, p in r.items()}
                      for c, r in results.items()}  # fmt: skip
            json.dump(counts, f, indent=1)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
