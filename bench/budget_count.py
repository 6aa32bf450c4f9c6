"""What one step costs on a GPU, counted from the ops the CUDA code path issues (issue 61).

`Counter` takes the reports of bench/budget_device.py's stand-in device and sums, per phase:
- launches: every leaf aten op that runs a kernel on a GPU (views, allocations and metadata ops
  run none) plus every Triton launch; the ops inside the project's custom ops are leaves too;
- bytes outside the GEMMs: each launch reads each tensor argument once (its distinct elements:
  a broadcast view counts its storage) and writes each result once; an op that only overwrites
  its argument (zero_, fill_, copy_'s destination, out=) does not read it, nor does a fill
  shaped like its argument (new_zeros, zeros_like, ...). Triton launches move
  each tensor argument once (read or written: the wrapper does not say which), but a pass
  over the tail rows only (TAIL_ONLY: rows past the last offset, none in a dropless layer
  where every row is live) moves nothing;
- GEMM FLOPs (mm, addmm, bmm, _grouped_mm, _scaled_grouped_mm, _scaled_mm and the Triton GEMM
  kernels, whose bytes are not counted outside the GEMMs; the e4m3 ones' also as fp8_flops);
  with meta tensors every row is a live row, exact for a dropless layer;
- e4m3 writes by operand (the quantization passes: every op or launch whose result is float8),
  named by the caller's `operand` (shape -> name);
- host syncs (`_local_scalar_dense`: .item(), int(t); a copy to the CPU) and collectives (c10d
  ops) with the bytes each sends (its arguments that it does not write).
Ops on CPU tensors only (an optimizer's step counts) are host work, not counted.
Every count is deterministic: no data is read, no time is measured.
"""

import dataclasses
from collections import Counter as Tally

import torch

NO_LAUNCH = {
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "alias",
    "lift_fresh", "_unsafe_view", "promote_types", "resize_", "set_", "_local_scalar_dense",
    "result_type", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
}  # fmt: skip
WRITE_ONLY = {"zero_", "fill_", "copy_", "normal_", "uniform_", "random_", "bernoulli_"}
LIKE = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}  # (a fill:
# their tensor argument gives the shape, dtype and device; it is not read)
GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "_grouped_mm", "_scaled_grouped_mm",
         "_scaled_mm"}  # fmt: skip
TRITON_GEMMS = {
    "_ragged_rows_kernel": (10, 11, 12, "GATED"),
    "_ragged_reduce_kernel": (8, 9, 10, "TWO_OUT"),
    "_block_mm_kernel": (6, 7, 8, "TWO"),  # moe/fp8/triton_block_gemm.py, on e4m3 tensor cores
    "_fp8_wgrad_kernel": (7, 8, 6, None),  # moe/fp8/triton_wgrad_gemm.py (K: the rows reduced)
    "_swiglu_mm_kernel": (12, 13, 14, True),  # moe/fp8/triton_swiglu_mm.py: up and gate
}  # fmt: skip  (M, N, K positions, the two-GEMM flag: True always two)
TRITON_FP8_GEMMS = {"_block_mm_kernel", "_fp8_wgrad_kernel", "_swiglu_mm_kernel"}
TAIL_ONLY = {"_zero_tail_kernel"}  # touches only the rows past the last offset: none here
FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}
PHASES = ("first", "later", "optimizer")  # micro-batch 1's fwd+bwd, the others', the step
FP8_GEMMS = {"_scaled_grouped_mm", "_scaled_mm"}


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of t's distinct elements (a stride-0 dim is read once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride != 0 else 1
    return n * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(tree)
    seen, out = set(), []
    for t in leaves:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def gemm_flops(name: str, args) -> int:
    """2 x M x K x N summed over the product's groups (every row live)."""
    if name in ("addmm", "addmm_", "baddbmm"):
        args = args[1:]
    a, b = args[0], args[1]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 3 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[1]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _base(func) -> str:
    return func._schema.name.split("::")[-1]


def _written(arg) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


def _is_view(func) -> bool:
    rets = func._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


@dataclasses.dataclass
class Phase:
    """One phase's sums (PHASES)."""

    launches: int = 0
    triton: int = 0
    gemms: int = 0
    bytes_outside: int = 0
    gemm_bytes: int = 0
    gemm_flops: int = 0
    fp8_flops: int = 0  # of gemm_flops, on e4m3 tensor cores
    syncs: int = 0
    collectives: int = 0
    collective_bytes: int = 0
    ops: Tally = dataclasses.field(default_factory=Tally)  # launch name -> count
    op_bytes: Tally = dataclasses.field(default_factory=Tally)  # launch name -> bytes outside
    e4m3: Tally = dataclasses.field(default_factory=Tally)  # operand name -> e4m3 writes
    custom: Tally = dataclasses.field(default_factory=Tally)  # custom op -> calls


class Counter:
    """Callbacks for budget_device.cuda_stand_in; `phase` names where reports go."""

    def __init__(self, operand=lambda shape: str(tuple(shape))):
        self.operand = operand
        self.phases = {p: Phase() for p in PHASES}
        self.phase = "first"
        self.enabled = True

    @property
    def now(self) -> Phase:
        return self.phases[self.phase]

    def _e4m3(self, outs) -> None:
        for t in outs:
            if t.dtype in FLOAT8:
                self.now.e4m3[self.operand(t.shape)] += 1

    def on_custom(self, func, depth: int) -> None:
        if self.enabled:
            self.now.custom[str(func.overloadpacket).removeprefix("moe.")] += 1

    def on_op(self, func, args, kwargs, out, depth: int) -> None:
        if not self.enabled:
            return
        name, p = _base(func), self.now
        if not any(t.is_meta for t in _tensors((args, kwargs, out))):
            return  # host work on CPU tensors (an optimizer's step counts): no device kernel
        if name == "_local_scalar_dense" or (
            name == "_to_copy" and str(kwargs.get("device", "")) == "cpu"
        ):
            p.syncs += 1
            return
        if func.namespace in ("c10d", "_c10d_functional"):
            sent = [a for a, s in zip(args, func._schema.arguments) if not _written(s)]
            p.collectives += 1
            p.collective_bytes += sum(map(distinct_bytes, _tensors(sent)))
            p.ops[f"{func.namespace}.{name}"] += 1
            return
        if name in NO_LAUNCH or _is_view(func):
            return
        outs = _tensors(out)
        written = {id(t) for t in outs}
        mutated = [
            args[i] if i < len(args) else kwargs.get(a.name)
            for i, a in enumerate(func._schema.arguments)
            if _written(a)
        ]
        ins = [t for t in _tensors((args, kwargs)) if id(t) not in written]
        if name in LIKE:
            ins = []
        if name in WRITE_ONLY or func._overloadname == "out":
            skip = {id(t) for t in mutated if isinstance(t, torch.Tensor)}
            ins = [t for t in ins if id(t) not in skip]
        moved = sum(map(distinct_bytes, ins)) + sum(map(distinct_bytes, outs))
        p.launches += 1
        p.ops[name] += 1
        self._e4m3(outs)
        if name in GEMMS:
            p.gemms += 1
            p.gemm_bytes += moved
            flops = gemm_flops(name, args)
            p.gemm_flops += flops
            p.fp8_flops += flops if name in FP8_GEMMS else 0
        else:
            p.bytes_outside += moved
            p.op_bytes[name] += moved

    def on_triton(self, name: str, grid, args, kwargs) -> None:
        if not self.enabled:
            return
        p = self.now
        p.launches += 1
        p.triton += 1
        p.ops[f"triton {name}"] += 1
        tensors = _tensors((args, kwargs))
        moved = 0 if name in TAIL_ONLY else sum(map(distinct_bytes, tensors))
        if name in TRITON_GEMMS:
            m, n, k, two = TRITON_GEMMS[name]
            p.gemms += 1
            p.gemm_bytes += moved
            # GATED doubles the up and dx roles (two GEMMs; TWO the block GEMM's up and gate
            # dgrad); the dact role's (EPILOGUE 2) is its epilogue's width: one GEMM
            pair = (two is True or kwargs.get(two)) and kwargs.get("EPILOGUE") != 2
            flops = 2 * args[m] * args[n] * args[k] * (2 if pair else 1)
            p.gemm_flops += flops
            p.fp8_flops += flops if name in TRITON_FP8_GEMMS else 0
        else:
            p.bytes_outside += moved
            p.op_bytes[f"triton {name}"] += moved
            self._e4m3(t for t in tensors if t.dtype in FLOAT8)
