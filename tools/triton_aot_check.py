"""Compile the Triton kernels for a GPU target on a machine without one (ahead-of-time check).

The interpreter (TRITON_INTERPRET=1) checks the math but is lenient about types and never
lowers to PTX. This builds every kernel role the way the JIT would specialise it for a large
Mixtral-like shape (ints equal to 1 become constants, pointers and multiples of 16 get the
divisibility hint) and reports, per variant, whether it uses wgmma and cp.async pipelining,
its shared memory, and from the cubin (cuobjdump) its registers and stack (spill) bytes.

  python -m tools.triton_aot_check [--arch 90] [--dtype bf16] [--all-configs]
Must run with TRITON_INTERPRET unset. Exit status 1 if a GEMM variant lacks wgmma (sm_90).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe.kernels.triton import gather_sum as gather_sum
from moe.kernels.triton import grouped_mm as rows
from moe.kernels.triton import grouped_mm_wgrad as wgrad
from moe.kernels.triton import schedule as schedule

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
D, F, E, M, T = 4096, 14336, 8, 32771, 16384


def _jit_fn(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def _resources(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "regs ?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([tool, "-res-usage", fh.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"regs {m.group(1):>3s} stack {m.group(2):>4s}" if m else "regs ?"


def compile_variant(kernel, args: dict, consts: dict, config, target) -> dict:
    """args: name -> pointer type string, or the int value the JIT would see."""
    fn = _jit_fn(kernel)
    consts = dict(consts)
    options = {}
    if config is not None:
        consts.update(config.kwargs)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str):
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=target, options=options)
    ptx = compiled.asm["ptx"]
    return dict(
        wgmma="wgmma" in ptx,
        cp_async="cp.async" in ptx,
        shared=compiled.metadata.shared,
        resources=_resources(compiled.asm["cubin"]) if "cubin" in compiled.asm else "regs ?",
    )


def variants(dtype: str, all_configs: bool):
    """(label, kernel, args, consts, config, is_gemm) for every role of every kernel."""
    p = f"*{dtype}"
    probe = {"a_ptr": torch.empty(0, dtype=DTYPES[dtype])}
    base = dict(a_ptr=p, idx_ptr="*i64", b_ptr=p, b2_ptr=p, bias_ptr=p, pre_ptr=p, out_ptr=p,
                offsets_ptr="*i32", scale_ptr="*fp32", rowdot_ptr="*fp32", M=M, E=E,
                M_BUCKET=65536, stride_biase=F)  # fmt: skip
    up = dict(N=F, K=D, stride_am=D, stride_ak=1, stride_be=D * F, stride_bk=F, stride_bn=1)
    roles = {
        "up gelu (gather, b1)": (dict(up, stride_pm=F, stride_om=F),
                                 dict(EPILOGUE=1, ACT=0, GATED=False, GATHER=True, HAS_BIAS=True, SAVE_PRE=True)),
        "up swiglu (gather)": (dict(up, stride_pm=2 * F, stride_om=F),
                               dict(EPILOGUE=1, ACT=4, GATED=True, GATHER=True, HAS_BIAS=False, SAVE_PRE=True)),
        "down (b2)": (dict(N=D, K=F, stride_am=F, stride_ak=1, stride_be=D * F, stride_bk=D, stride_bn=1,
                           stride_pm=D, stride_om=D),
                      dict(EPILOGUE=0, ACT=0, GATED=False, GATHER=False, HAS_BIAS=True, SAVE_PRE=False)),
        "dact swiglu (w2^T)": (dict(N=F, K=D, stride_am=D, stride_ak=1, stride_be=D * F, stride_bk=1,
                                    stride_bn=D, stride_pm=2 * F, stride_om=2 * F),
                               dict(EPILOGUE=2, ACT=4, GATED=True, GATHER=False, HAS_BIAS=False, SAVE_PRE=False)),
        "dx swiglu (w1^T, w3^T)": (dict(N=D, K=F, stride_am=2 * F, stride_ak=1, stride_be=D * F, stride_bk=1,
                                        stride_bn=F, stride_pm=D, stride_om=D),
                                   dict(EPILOGUE=0, ACT=0, GATED=True, GATHER=False, HAS_BIAS=False, SAVE_PRE=False)),
    }  # fmt: skip
    for role in ("up swiglu (gather)", "dact swiglu (w2^T)"):  # combine weights folded in
        ints, flags = roles[role]
        roles[role + " row scale"] = (ints, dict(flags, ROW_SCALE=True))
    for role, (ints, flags) in roles.items():
        flags = dict(flags, ROW_SCALE=flags.get("ROW_SCALE", False))
        configs = rows._prune(rows._configs(), probe, **flags)
        for cfg in configs if all_configs else configs[:1]:
            consts = dict(flags, DOT_F32=False, PRECISION="tf32", E_POW2=16, EVEN_K=True, GROUP_M=8)
            yield f"rows {role}", rows._ragged_rows_kernel, dict(base, **ints), consts, cfg, True
    red = dict(a_ptr=p, idx_ptr="*i64", b_ptr=p, offsets_ptr="*i32", order_ptr="*i32", out_ptr=p,
               dbias_ptr="*fp32", M=M, I=D, J=F, E=E, M_BUCKET=65536, stride_am=D, stride_bm=2 * F,
               stride_oe=D * F, stride_oi=F, stride_dbe=F)  # fmt: skip
    configs = wgrad._prune(wgrad._configs(), probe)
    for cfg in configs if all_configs else configs[:1]:
        flags = dict(GATHER=True, HAS_DBIAS=True, DOT_F32=False, PRECISION="tf32")
        yield "wgrad (gather, db)", wgrad._ragged_reduce_kernel, red, flags, cfg, True
    gs = dict(src_ptr=p, rows_ptr="*i64", seg_ptr="*i64", w_ptr="*fp32", out_ptr=p, T=T, D=D, M=M,
              KF=2, stride_s=D, stride_o=D)  # fmt: skip
    for fixed in (True, False):
        flags = dict(FIXED_K=fixed, WEIGHTED=fixed, BLOCK_T=16, BLOCK_D=256)
        label = "combine fwd" if fixed else "rows_to_tokens"
        yield label, gather_sum._gather_sum_kernel, gs, flags, None, False
    cb = dict(dy_ptr=p, out_ptr=p, rows_ptr="*i64", w_ptr="*fp32", dout_ptr=p, dw_ptr="*fp32", T=T,
              D=D, M=M, KF=2, stride_dy=D, stride_out=D, stride_dout=D)  # fmt: skip
    flags = dict(K_POW2=2, BLOCK_T=16, BLOCK_D=256)
    yield "combine bwd", gather_sum._combine_bwd_kernel, cb, flags, None, False
    sched = dict(offsets_ptr="*i32", out_ptr="*i32", E=512, M=M)
    yield (
        "schedule (E=512)",
        schedule._schedule_kernel,
        sched,
        dict(BLOCK_M=128, E_POW2=1024),
        None,
        False,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument(
        "--all-configs", action="store_true", help="every autotune config, not the first"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this check compiles the kernels", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, target sm_{args.arch}, {args.dtype}")
    bad = 0
    for label, kernel, kargs, consts, cfg, is_gemm in variants(args.dtype, args.all_configs):
        r = compile_variant(kernel, kargs, consts, cfg, target)
        shape = (
            ""
            if cfg is None
            else " ".join(str(v) for v in cfg.kwargs.values())
            + f" w{cfg.num_warps}s{cfg.num_stages}"
        )
        print(f"{label:28s} {shape:20s} wgmma {r['wgmma']!s:5s} cp.async {r['cp_async']!s:5s} "
              f"shared {r['shared']:6d}  {r['resources']}")  # fmt: skip
        if is_gemm and args.arch >= 90 and not r["wgmma"]:
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
