"""Per-step launch, byte and FLOP budgets of one MoE layer from the CUDA code path, on CPU
(issue 61).

    python -m bench.budget                      # every variant at the four GPU-table shapes
    python -m bench.budget --shapes tiny --variants "bf16 torch,fp8 rowwise"
    python -m bench.budget --micro-batches 4 --out bench/results/2026-12-07-budget.md

Each variant is one moe.MoELayer (SwiGLU, dropless, bf16 masters) built on the meta device and
run on bench/budget_device.py's CUDA stand-in (sm_90): one warm-up step, then M micro-batches of
fwd+bwd and one AdamW step (foreach, as on a GPU), counted by bench/budget_count.py. The
figures of a row are micro-batch 1's fwd+bwd (where a weight cache would be filled), the
optimizer step's, and the e4m3 writes of the expert weights over the whole step (M
micro-batches + the optimizer step).

The floors are projections, not measurements: bytes moved (outside the GEMMs and the GEMMs'
operands) at the HBM bandwidth of an H100 SXM (3.35 TB/s) or an H200 (4.8 TB/s), or the GEMM
FLOPs at the dense peak (989 TFLOP/s bf16, 1979 e4m3; the same on both), whichever is larger.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import sys

import torch

import moe
from bench.budget_count import PHASES, Counter, Phase
from bench.budget_device import cuda_stand_in, to_stand_in
from bench.titan_style import Shape, parse_shapes

TINY = Shape("tiny", 40, 32, 4, 2, 48)  # T*d, E*d*F, T*k*d, T*k*F differ; widths 16-aligned
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # HBM bytes/s (SXM)
PEAK_BF16, PEAK_FP8 = 989e12, 1979e12  # dense tensor-core FLOP/s, H100 SXM = H200
DTYPE = torch.bfloat16


def _fp8(**kw):
    from moe.fp8 import FP8Config

    return {"fp8": FP8Config(**kw)}


VARIANTS = {  # name -> MoELayer options (lora: adapters added after the build)
    "bf16 torch": {"backend": "torch"},
    "bf16 triton": {"backend": "triton"},
    "bf16 cutlass": {"backend": "triton_cutlass"},
    "fp8 rowwise": lambda: _fp8(experts=True),
    "fp8 rowwise +dispatch": lambda: _fp8(experts=True, dispatch=True),
    "fp8 rowwise bf16-wgrad": lambda: _fp8(experts=True, wgrad_bf16=True),
    "fp8 blockwise": lambda: _fp8(experts=True, recipe="blockwise"),
    "fp8 blockwise +dispatch": lambda: _fp8(experts=True, dispatch=True, recipe="blockwise"),
    "lora r16": {"backend": "torch", "lora": 16},
    "bf16 torch ep2": {"backend": "torch", "ep": 2},
    "fp8 rowwise +dispatch ep2": lambda: _fp8(experts=True, dispatch=True) | {"ep": 2},
}


def operand_namer(s: Shape, ep: int = 1):
    """Names an e4m3 result by its shape: the (local) expert weights, routed rows, tokens, or
    scales."""
    R, L = s.T * s.k, s.E // ep

    def name(shape) -> str:
        n = math.prod(shape)
        if shape[0] == L and n == L * s.d * s.F:
            return "weights"
        if shape[0] == R and n in (R * s.d, R * s.F):
            return "rows"
        if shape[0] == s.T and n == s.T * s.d:
            return "tokens"
        if len(shape) == 2 and shape[0] in (s.d, s.F) and shape[1] == 16 * (-(-R // 16) + L):
            return "rows"  # transposed, each expert's rows padded: moe/fp8/triton_wgrad_gemm.py
        return "scales"

    return name


def balanced_reads(s: Shape, ep: int = 1):
    """Host reads as a balanced routing answers them, on EP rank 0 of `ep`: an int tensor of the
    L = E / ep local experts reads as their cumulative row ends (R = T k rows arrive, R / L
    each); the expert-parallel count table [2 ep, L + 1 + extras] (sent, then received) as R / E
    rows per (rank, local expert), total R, extras 0; anything else as ones."""
    R, L = s.T * s.k, s.E // ep

    def values(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return torch.ones(t.shape, dtype=t.dtype)
        if t.dim() == 1 and t.numel() == L:
            return (torch.arange(1, L + 1) * (R // L)).to(t.dtype)
        if ep > 1 and t.dim() == 2 and t.shape[0] == 2 * ep and t.shape[1] > L:
            v = torch.zeros(t.shape, dtype=t.dtype)
            v[:, :L], v[:, L] = R // s.E, R
            return v
        return torch.ones(t.shape, dtype=t.dtype)

    return values


def build(variant: str, s: Shape) -> torch.nn.Module:
    opts = VARIANTS[variant]
    opts = dict(opts() if callable(opts) else opts)
    rank, ep = opts.pop("lora", None), opts.pop("ep", 1)
    layer = moe.MoELayer(s.d, s.F, s.E, top_k=s.k, capacity_factor=None, activation="swiglu",
                         device="meta", dtype=DTYPE, **opts)  # fmt: skip
    if rank is not None:
        from moe.lora import LoRAConfig, add_lora

        add_lora(layer, LoRAConfig(rank=rank, alpha=2 * rank))
    if ep > 1:
        expert_parallel(layer, ep)
    return layer


def expert_parallel(layer, ep: int) -> None:
    """EP rank 0 of `ep` (the default process group, a fake one in measure()): this rank's
    E / ep experts, and the expert-parallel dispatcher with the layer's wire (flat exchange),
    as parallelize installs them (without its DTensors and data-parallel wrapping)."""
    import torch.distributed as dist

    from moe.dispatch.expert_parallel import ExpertParallelDispatcher
    from moe.dispatch.wire import wire_for

    L = layer.experts.num_experts // ep
    for name, p in list(layer.experts.named_parameters(recurse=False)):
        local = torch.nn.Parameter(p.detach()[:L].clone(), p.requires_grad)
        setattr(layer.experts, name, local)
    layer.experts.expert_offset, layer.experts.num_local_experts = 0, L
    wire = wire_for(layer.config)
    layer.dispatcher = ExpertParallelDispatcher(
        dist.group.WORLD, L, algorithm="flat", ranks_per_node=ep,
        **({} if wire.plain else {"wire": wire}),
    )  # fmt: skip


@contextlib.contextmanager
def fake_ranks(ep: int):
    """A fake default process group of `ep` ranks (this process is rank 0) while the block
    runs: collectives return at once, and the counter sees each one."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if ep == 1 or dist.is_initialized():
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ep)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclasses.dataclass
class Budget:
    """One (variant, shape): the phases' sums and the step's weight quantizations."""

    variant: str
    shape: Shape
    micro_batches: int
    first: Phase
    later: Phase
    optimizer: Phase

    @property
    def weight_casts(self) -> int:
        """e4m3 writes of expert weights over the step (every micro-batch + the optimizer)."""
        return sum(p.e4m3["weights"] for p in (self.first, self.later, self.optimizer))

    def floor_ms(self, gpu: str) -> float:
        """Micro-batch 1's fwd+bwd at the bandwidth or FLOP floor, whichever is larger."""
        p = self.first
        bytes_ms = (p.bytes_outside + p.gemm_bytes) / BANDWIDTH[gpu] * 1e3
        flops_ms = ((p.gemm_flops - p.fp8_flops) / PEAK_BF16 + p.fp8_flops / PEAK_FP8) * 1e3
        return max(bytes_ms, flops_ms)

    def outside_ms(self, gpu: str) -> float:
        return self.first.bytes_outside / BANDWIDTH[gpu] * 1e3


def measure(variant: str, s: Shape, micro_batches: int = 1) -> Budget:
    """Count one step of `variant` at shape s on the CUDA stand-in."""
    opts = VARIANTS[variant]
    ep = (opts() if callable(opts) else opts).get("ep", 1)
    with fake_ranks(ep):
        return _measure(variant, s, micro_batches, ep)


def _measure(variant: str, s: Shape, micro_batches: int, ep: int) -> Budget:
    layer = build(variant, s)
    counter = Counter(operand_namer(s, ep))
    reads = balanced_reads(s, ep)
    with cuda_stand_in(counter.on_op, counter.on_custom, counter.on_triton, reads):
        counter.enabled = False
        to_stand_in(layer)
        params = [p for p in layer.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)

        def fwd_bwd():
            x = torch.empty(s.T, s.d, device="cuda", dtype=DTYPE, requires_grad=True)
            y = layer(x)
            (y * 1).backward(torch.empty_like(y))  # the upstream gradient, already on device

        fwd_bwd()  # warm-up: optimizer state, lazy setup
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter.enabled = True
        for i in range(micro_batches):
            counter.phase = "first" if i == 0 else "later"
            fwd_bwd()
        counter.phase = "optimizer"
        opt.step()
    return Budget(variant, s, micro_batches, *(counter.phases[p] for p in PHASES))


COLUMNS = (
    "shape", "variant", "launches", "launches mb 2+", "Triton", "GEMMs", "MB outside GEMMs", "GEMM TFLOP",
    "e4m3 writes", "weight e4m3 / step", "syncs", "collectives", "opt launches", "opt MB",
    "floor ms H100", "floor ms H200", "outside ms H100", "outside ms H200",
)  # fmt: skip


def row(b: Budget) -> list[str]:
    p, o = b.first, b.optimizer
    later = b.later.launches // (b.micro_batches - 1) if b.micro_batches > 1 else p.launches
    return [
        b.shape.name, b.variant, str(p.launches), str(later), str(p.triton), str(p.gemms),
        f"{p.bytes_outside / 1e6:,.1f}", f"{p.gemm_flops / 1e12:.2f}",
        str(sum(p.e4m3.values())), str(b.weight_casts), str(p.syncs), str(p.collectives),
        str(o.launches), f"{o.bytes_outside / 1e6:,.1f}",
        f"{b.floor_ms('H100'):.2f}", f"{b.floor_ms('H200'):.2f}",
        f"{b.outside_ms('H100'):.2f}", f"{b.outside_ms('H200'):.2f}",
    ]  # fmt: skip


def record(b: Budget) -> dict:
    """The figures tests/test_budget.py holds a variant to (every count an upper bound but the
    FLOPs, which the shapes fix)."""
    p, o = b.first, b.optimizer
    keys = ("launches", "triton", "gemms", "bytes_outside", "gemm_flops", "syncs", "collectives")
    return {
        **{k: getattr(p, k) for k in keys},
        "weight_casts": b.weight_casts,
        "opt_launches": o.launches,
        "opt_bytes": o.bytes_outside,
        "e4m3": dict(sorted(p.e4m3.items())),
        "ops": dict(sorted(p.ops.items())),
    }


def markdown(budgets: list[Budget]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(b)) + " |" for b in budgets]
    return "\n".join(lines)


def per_micro_batch(b: Budget) -> tuple[float, float]:
    """(launches, bytes outside the GEMMs) per micro-batch over the step's M micro-batches."""
    p, later = b.first, b.later
    M = b.micro_batches
    return (p.launches + later.launches) / M, (p.bytes_outside + later.bytes_outside) / M


def fp8_vs_bf16(budgets: list[Budget], base: str = "bf16 torch") -> list[str]:
    """Issue 61's targets per shape, per micro-batch over the step (the weights' quantization
    is once per step): FP8 launches <= bf16 + 12, bytes outside the GEMMs <= 1.25x, each weight
    form written once per step (2 per weight: rowwise the forward's and the dgrad's scaling,
    blockwise the 128 x 128 block codes in both orientations, one launch)."""
    by = {(b.shape.name, b.variant): b for b in budgets}
    out = []
    for b in budgets:
        ref = by.get((b.shape.name, base + (" ep2" if b.variant.endswith(" ep2") else "")))
        if not b.variant.startswith("fp8") or ref is None:
            continue
        (n, byt), (n_ref, byt_ref) = per_micro_batch(b), per_micro_batch(ref)
        forms = 3 * 2
        ratio = byt / max(byt_ref, 1)
        ok = n <= n_ref + 12 and ratio <= 1.25 and b.weight_casts <= forms
        out.append(
            f"- {b.shape.name}, {b.variant}: per micro-batch {n:.0f} launches = {ref.variant} "
            f"{n - n_ref:+.0f}, bytes outside GEMMs {ratio:.2f}x (micro-batch 1: "
            f"{b.first.launches - ref.first.launches:+d} launches, "
            f"{b.first.bytes_outside / max(ref.first.bytes_outside, 1):.2f}x); weight e4m3 "
            f"writes per step {b.weight_casts} ({forms} forms): "
            f"{'meets' if ok else 'misses'} the targets"
        )
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all", help="bench.titan_style.parse_shapes, or 'tiny'")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--json", default=None, help="write {shape: {variant: record}} here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shapes = [TINY] if args.shapes == "tiny" else parse_shapes(args.shapes)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"--variants: unknown {v!r}; known: {', '.join(VARIANTS)}")
    budgets = []
    for s in shapes:
        for v in variants:
            budgets.append(measure(v, s, args.micro_batches))
            print(" | ".join(row(budgets[-1])), flush=True)
    table = markdown(budgets)
    verdicts = "\n".join(fp8_vs_bf16(budgets))
    print(table, verdicts, sep="\n\n")
    if args.json:
        data: dict = {}
        for b in budgets:
            data.setdefault(b.shape.name, {})[b.variant] = record(b)
        with open(args.json, "w") as f:
            json.dump({"micro_batches": args.micro_batches, "budgets": data}, f, indent=1)
            f.write("\n")
    if args.out:
        shape_text = "; ".join(f"{s.name} (T {s.T}, d {s.d}, E {s.E}, k {s.k}, F {s.F})"
                               for s in shapes)  # fmt: skip
        with open(args.out, "w") as f:
            f.write(REPORT.format(date=datetime.date.today(), argv=" ".join(sys.argv[1:]),
                                  shapes=shape_text, mb=args.micro_batches, table=table,
                                  verdicts=verdicts))  # fmt: skip
    return 0


REPORT = """# Per-step budgets from the CUDA code path, counted on CPU ({date})

**CPU-counted, not measured.** `python -m bench.budget {argv}` ran each variant on the CUDA
stand-in (meta tensors that report cuda:0, sm_90; bench/budget_device.py): one moe.MoELayer
(SwiGLU, dropless, bf16 masters) per row, at {shapes}.

Launches, bytes, FLOPs, e4m3 writes and syncs are micro-batch 1's fwd+bwd after a warm-up
step ("launches mb 2+": each later micro-batch's); "weight e4m3 / step" counts the passes writing the expert weights in e4m3 over {mb}
micro-batches and the optimizer step; "opt" is the AdamW step (foreach). **The ms columns are
projections** (lower bounds), not timings: bytes at 3.35 TB/s (H100 SXM) and 4.8 TB/s (H200)
HBM, or the GEMM FLOPs at 989 (bf16) / 1979 (e4m3) TFLOP/s, whichever is larger; "outside ms"
is the bytes outside the GEMMs alone. How each figure is counted: docs/budget.md.

{table}

FP8 against bf16 torch, per micro-batch over the step's {mb} micro-batches (issue 61's targets:
launches <= bf16 + 12, bytes outside GEMMs <= 1.25x, each weight form written once per
optimizer step: 2 per weight, rowwise the forward's and the dgrad's scaling, blockwise the
128 x 128 codes in the forward's and the dgrad's orientation, both from one launch):

{verdicts}
"""

if __name__ == "__main__":
    sys.exit(main())
