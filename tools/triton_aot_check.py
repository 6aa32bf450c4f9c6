"""Compile the Triton kernels for a GPU target on a machine without one (ahead-of-time check).

The interpreter (TRITON_INTERPRET=1) checks the math but is lenient about types and never
lowers to PTX. This builds every kernel role the way the JIT would specialise it at the four GPU
benchmark shapes (bench/gpu_layer.py; ints equal to 1 become constants, pointers and multiples of
16 get the divisibility hint), for every config the autotuner may pick (after `_prune`), and
reads the facts that decide Hopper speed from the compiled kernel:
  wgmma     the GEMM uses Hopper's warpgroup MMA (PTX `wgmma`)
  tma       tensor-descriptor loads (PTX `cp.async.bulk.tensor`) where the role is meant to
  spills    ptxas's stack / local memory (cuobjdump -res-usage): any byte is a spill
  pipelined every GEMM main loop (an scf.for holding a warp_group_dot in the TTGIR) issues its
            tile loads asynchronously and never waits for all of them at once (`async_wait
            {num = 0}` inside the loop is a full drain every iteration, i.e. no overlap)

  python -m tools.triton_aot_check [--arch 90] [--dtype bf16] [--shapes mixtral,...] [--first]
                                   [--jobs N]   (parallel compiles; identical ones run once)
Must run with TRITON_INTERPRET unset. Exit status 1 if, on sm_90+, a GEMM variant lacks wgmma,
a TMA role lacks TMA, any GEMM config spills, or a GEMM main loop is not pipelined; 2 on misuse.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe.kernels.triton import activations as activations
from moe.kernels.triton import gather_sum as gather_sum
from moe.kernels.triton import grouped_mm as rows
from moe.kernels.triton import grouped_mm_wgrad as wgrad
from moe.kernels.triton import row_passes as row_passes
from moe.kernels.triton import schedule as schedule

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (T, d, E, k, F) of bench/gpu_layer.py's shapes
SHAPES = {
    "mixtral": (8192, 4096, 8, 2, 14336),
    "olmoe": (16384, 2048, 64, 8, 1024),
    "qwen3": (16384, 2048, 128, 8, 768),
    "deepseek": (8192, 7168, 64, 8, 2048),
}


def _jit_fn(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def resources(cubin: bytes) -> dict:
    """{'regs', 'stack', 'local'} from cuobjdump -res-usage ({} when cuobjdump is missing)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([tool, "-res-usage", fh.name], capture_output=True, text=True).stdout
    return parse_resources(out)


def parse_resources(text: str) -> dict:
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if not m:
        return {}
    local = re.search(r"LOCAL:(\d+)", text)
    return dict(
        regs=int(m.group(1)), stack=int(m.group(2)), local=int(local.group(1) if local else 0)
    )


def _loops(ttgir: str) -> list[list[str]]:
    """The body lines of every scf.for (nested loops' lines excluded from their parent's)."""
    loops, stack = [], []
    for line in ttgir.splitlines():
        code = re.sub(r'loc\(.*?\)|"[^"]*"', "", line)
        opens = "scf.for" in code and code.rstrip().endswith("{")
        if opens:
            stack.append(([], 0))
        if not stack:
            continue
        body, depth = stack[-1]
        if not opens:
            body.append(code)
        depth += code.count("{") - code.count("}")
        stack[-1] = (body, depth)
        if depth <= 0:
            loops.append(stack.pop()[0])
    return loops


def unpipelined_loops(ttgir: str) -> list[str]:
    """Why each GEMM main loop (a loop with a warp_group_dot / dot) is not pipelined, if it is
    not: a synchronous tile load in the loop, or a full async_wait drain per iteration. (A
    vector load, e.g. the FP8 block GEMM's per-row scales read one K block ahead, is not a tile:
    Triton's pipeliner stages only the dot's operands.)"""
    problems = []
    for body in _loops(ttgir):
        text = "\n".join(body)
        if not re.search(r"warp_group_dot |tt\.dot |ttng\.tc_gen5_mma", text):
            continue
        if re.search(r"async_wait [^\n]*\{num = 0 : i32\}", text):
            problems.append("async_wait {num = 0} in the loop (loads drained every iteration)")
        tile_load = r"= tt\.(load|descriptor_load) [^\n]*: (tensor<\d+x\d+|!tt\.tensordesc)"
        if re.search(tile_load, text):
            problems.append("synchronous tensor load in the loop")
    return problems


def _spec(kernel, args: dict, consts: dict, config):
    """What triton.compile gets for one variant, and a key equal for identical compiles."""
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
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    key = (fn.__name__, repr(sorted(consts.items())), repr(signature), repr(attrs), repr(options))
    return fn, signature, consts, attrs, options, key


def compile_variant(kernel, args: dict, consts: dict, config, target, cache: dict) -> dict:
    """args: name -> pointer type string, or the int value the JIT would see."""
    fn, signature, consts, attrs, options, key = _spec(kernel, args, consts, config)
    if key in cache:
        return cache[key]
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=target, options=options)
    ptx = compiled.asm["ptx"]
    cache[key] = r = dict(
        wgmma="wgmma" in ptx,
        tma="cp.async.bulk.tensor" in ptx,
        cp_async="cp.async" in ptx,
        shared=compiled.metadata.shared,
        res=resources(compiled.asm["cubin"]) if "cubin" in compiled.asm else {},
        unpipelined=unpipelined_loops(compiled.asm["ttgir"]),
    )
    return r


def _all_variants(dtype: str, shapes: list[str], first: bool) -> list[tuple]:
    return [
        (name, v)
        for i, name in enumerate(shapes)
        for v in variants(dtype, SHAPES[name], first, gelu=i == 0)
    ]


def _compile_job(job):
    """Worker: compile variant number `index` of the same list the parent built."""
    dtype, shapes, first, arch, index = job
    _, (label, kernel, kargs, consts, cfg, _, _) = _all_variants(dtype, shapes, first)[index]
    return compile_variant(kernel, kargs, consts, cfg, GPUTarget("cuda", arch, 32), {})


def variants(dtype: str, shape: tuple, first_only: bool, gelu: bool = False):
    """(label, kernel, args, consts, config, is_gemm, wants_tma) for every role of every kernel
    at one (T, d, E, k, F) shape."""
    T, D, E, k, F = shape
    M = T * k
    p = f"*{dtype}"
    probe = {"a_ptr": torch.empty(0, dtype=DTYPES[dtype])}
    mb = triton.next_power_of_2(M)
    base = dict(a_ptr=p, idx_ptr="*i64", b_ptr=p, b2_ptr=p, bias_ptr=p, pre_ptr=p, out_ptr=p,
                offsets_ptr="*i32", scale_ptr="*fp32", rowdot_ptr="*fp32", act_ptr=p, M=M, E=E,
                M_BUCKET=mb, stride_biase=F, NUM_PROGS=132)  # fmt: skip
    up = dict(N=F, K=D, stride_am=D, stride_ak=1, stride_be=D * F, stride_bk=F, stride_bn=1)
    roles = {
        "up swiglu (gather)": (dict(up, stride_pm=2 * F, stride_om=F),
                               dict(EPILOGUE=1, ACT=4, GATED=True, GATHER=True, HAS_BIAS=False, SAVE_PRE=True)),
        "down": (dict(N=D, K=F, stride_am=F, stride_ak=1, stride_be=D * F, stride_bk=D, stride_bn=1,
                      stride_pm=D, stride_om=D),
                 dict(EPILOGUE=0, ACT=0, GATED=False, GATHER=False, HAS_BIAS=False, SAVE_PRE=False)),
        "dact swiglu (w2^T)": (dict(N=F, K=D, stride_am=D, stride_ak=1, stride_be=D * F, stride_bk=1,
                                    stride_bn=D, stride_pm=2 * F, stride_om=2 * F),
                               dict(EPILOGUE=2, ACT=4, GATED=True, GATHER=False, HAS_BIAS=False, SAVE_PRE=False)),
        "dx swiglu (w1^T, w3^T)": (dict(N=D, K=F, stride_am=2 * F, stride_ak=1, stride_be=D * F, stride_bk=1,
                                        stride_bn=F, stride_pm=D, stride_om=D),
                                   dict(EPILOGUE=0, ACT=0, GATED=True, GATHER=False, HAS_BIAS=False, SAVE_PRE=False)),
    }  # fmt: skip
    if gelu:
        roles["up gelu (gather, b1)"] = (
            dict(up, stride_pm=F, stride_om=F),
            dict(EPILOGUE=1, ACT=0, GATED=False, GATHER=True, HAS_BIAS=True, SAVE_PRE=True),
        )
    for role in ("up swiglu (gather)", "dact swiglu (w2^T)"):  # combine weights folded in
        ints, flags = roles[role]
        roles[role + " row scale"] = (ints, dict(flags, ROW_SCALE=True))
    ints, flags = roles["dact swiglu (w2^T) row scale"]  # the layer's: s * act(pre) written too
    roles["dact swiglu (w2^T) row scale + act"] = (ints, dict(flags, SAVE_ACT=True))
    for role, (ints, flags) in roles.items():
        flags = dict(flags, ROW_SCALE=flags.get("ROW_SCALE", False))
        flags = dict(flags, SAVE_ACT=flags.get("SAVE_ACT", False))
        configs = rows._prune(rows._configs(), probe, **flags)
        for tma in (False, True):  # the pointer path (default) and the opt-in TMA path
            for cfg in configs[:1] if first_only else configs:
                consts = dict(flags, DOT_F32=False, PRECISION="tf32", E_POW2=triton.next_power_of_2(E + 1),
                              EVEN_K=ints["K"] % cfg.kwargs["BLOCK_K"] == 0, GROUP_M=8, USE_TMA=tma,
                              B_T=ints["stride_bn"] != 1)  # fmt: skip
                label = f"rows {role}{' TMA' if tma else ''}"
                yield label, rows._ragged_rows_kernel, dict(base, **ints), consts, cfg, True, tma
    yield from wgrad_variants(p, probe, M, D, E, F, first_only)
    yield from fp8_wgrad_variants(M, D, E, F, first_only)
    yield from fp8_block_gemm_variants(M, D, E, F, first_only)
    if gelu:
        yield from misc_variants(p, M, D, T)
        yield from row_variants(p, M, D, F)
        yield from fp8_variants(p, M, D, E)


def fp8_variants(p, M, D, E):
    """The FP8 quantization kernel (moe/fp8/triton_quant.py) in the configurations its launchers
    use: row-wise codes only, rows + the transposed copy (weights; codes), rows + the padded
    column codes (a gradient's two forms; blockwise: the columns only), and the padded column
    codes from gathered kept codes (DEQ + GATHER): the FP8 weight-gradient GEMM's operands.
    Imported here, not with this module: @triton.jit picks compiled or interpreted when the
    kernel module is imported, and the tests import this module before TRITON_INTERPRET is set."""
    from moe.fp8 import triton_blocks
    from moe.fp8 import triton_quant as fp8_quant

    args = dict(x_ptr=p, ids_ptr="*i64", xs_ptr="*fp32", q_ptr="*fp8e4nv", s_ptr="*fp32",
                qv_ptr=p, qc_ptr="*fp8e4nv", sc_ptr="*fp32", offsets_ptr="*i32", pad_ptr="*i32",
                M=M, K=D, G=8, n_pad=0, stride_xm=D, xs_nb=1, xs_block=D, col_s1=M, col_s2=0,
                n_row_programs=M // 4, floor="fp32")  # fmt: skip
    pad = {"n_pad": E, "col_s1": 16 * (-(-M // 16) + E), "PAD_POW2": triton.next_power_of_2(E)}
    blocks = dict(BLOCK_M=fp8_quant.ROW_BLOCK_M, BLOCK_K=fp8_quant._row_block_k(D),
                  CBLOCK_M=fp8_quant.COL_BLOCK_M, CBLOCK_K=fp8_quant._col_block_k(D))  # fmt: skip
    table = (  # label, ROWS, COLS, ROW_VALUES, DEQ, GATHER, POW2, overrides
        ("rows", True, False, False, False, False, False, {}),
        ("rows pow2", True, False, False, False, False, True, {}),
        ("rows + transposed codes", True, True, False, False, False, True, {}),
        ("rows + padded column codes", True, True, False, False, False, True, pad),
        ("padded column codes", False, True, False, False, False, True, pad),
        ("1 x 128 rows + values", True, False, True, False, False, True, {"K": 128}),
        ("1 x 128 rows, values only", True, False, True, False, False, True,
         {"K": 128, "ROW_CODES": False}),
        ("padded column codes of kept codes", False, True, False, True, True, True,
         dict(pad, x_ptr="*u8")),
        ("padded tile columns of kept 1 x 128 codes", False, True, False, True, True, True,
         dict(pad, x_ptr="*u8", xs_nb=D // 128, xs_block=128, G=M // 128 + E + 1)),
    )  # fmt: skip
    for label, by_rows, cols, row_values, deq, gather, pow2, over in table:
        consts = dict(blocks, POW2=pow2, ROWS=by_rows, COLS=cols, ROW_VALUES=row_values,
                      ROW_CODES=over.get("ROW_CODES", True), DEQ=deq,
                      GATHER=gather, PAD_POW2=over.get("PAD_POW2", 0))  # fmt: skip
        kernel = fp8_quant._quant_kernel
        kargs = dict(args, **{k: v for k, v in over.items() if k not in ("ROW_CODES", "PAD_POW2")})
        yield f"fp8 quant {label}", kernel, kargs, consts, None, False, False
    wb = dict(w_ptr=p, q_ptr="*fp8e4nv", s_ptr="*fp32", qt_ptr="*fp8e4nv", K=D, N=D, kb=D // 128,
              nb=D // 128, floor="fp32")  # fmt: skip
    consts = dict(POW2=True, B=128, R=triton_blocks.WEIGHT_CHUNK)
    yield (
        "fp8 weight 128 x 128 blocks",
        triton_blocks._weight_blocks_kernel,
        wb,
        consts,
        None,
        False,
        False,
    )
    dq = dict(q_ptr="*u8", s_ptr="*fp32", out_ptr=p, M=M, K=D, nb=D // 128, stride_qm=D + 64)
    consts = dict(BLOCK_M=16, BLOCK_K=128)
    yield "fp8 dequantize 1 x 128", triton_blocks._dequantize_kernel, dq, consts, None, False, False
    yield from fp8_dispatch_variants(p, M, D)


def fp8_dispatch_variants(p, M, D):
    """The FP8 dispatch rows' two kernels: the payload written from the rows in one launch
    (moe/fp8/triton_payload.py; fp32 and UE8M0 scales) and the arrived codes requantized for
    the rowwise GEMM through the permutation (moe/fp8/triton_requant.py; bf16 rows)."""
    from moe.fp8 import triton_payload, triton_requant

    P = D + 4 * (D // 128)  # a row of the payload: codes, then fp32 scales of 1 x 128 blocks
    pay = dict(x_ptr=p, p_ptr="*fp8e4nv", M=M, D=D, nb=D // 128, eb=128, stride_x=D, P=P,
               floor="fp32")  # fmt: skip
    for ue8m0 in (False, True):
        consts = dict(POW2=ue8m0, UE8M0=ue8m0, BLOCK_M=triton_payload.BLOCKS_PER_PROGRAM, BP=128)
        label = "fp8 dispatch payload" + (" ue8m0" if ue8m0 else "")
        yield label, triton_payload._payload_kernel, pay, consts, None, False, False
    rq = dict(q_ptr="*u8", s_ptr="*fp32", ids_ptr="*i64", out_q_ptr="*fp8e4nv", out_s_ptr="*fp32",
              M=M, W=D, per_row=1, stride_s=P // 4, D=D, stride_q=P, floor="fp32")  # fmt: skip
    consts = dict(SB=128, DTYPE=1, POW2=True, GATHER=True,
                  BLOCK_M=triton_requant.ROWS_PER_PROGRAM, BLOCK_K=min(512, D))  # fmt: skip
    yield (
        "fp8 dispatch rows requantized",
        triton_requant._requant_kernel,
        rq,
        consts,
        None,
        False,
        False,
    )


def fp8_wgrad_variants(M, D, E, F, first_only):
    """The FP8 weight-gradient GEMM (moe/fp8/triton_wgrad_gemm.py) for dW1 (and dW3) and dW2,
    rowwise (one scaling group per expert) and blockwise (per 128-row tile): e4m3 codes [K, M']
    and [N, M'] in the padded layout (the rows contiguous: K-major for wgmma). Imported here
    (see fp8_variants)."""
    from moe.fp8 import triton_wgrad_gemm as fw

    width = 16 * (-(-M // 16) + E)  # triton_quant.quantize(padded=...)'s row length
    args = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", sa_ptr="*fp32", sb_ptr="*fp32",
                offsets_ptr="*i32", out_ptr="*bf16", M=M, E=E, M_BUCKET=triton.next_power_of_2(M),
                stride_a=width, stride_b=width)  # fmt: skip
    for label, K, N in (("dW1", D, F), ("dW2", F, D)):
        for recipe, group_rows in (("rowwise", 0), ("blockwise", fw.TILE)):
            consts = dict(GROUP_ROWS=group_rows, E_POW2=triton.next_power_of_2(E), DECODE=False,
                          GROUP_K=8)  # fmt: skip
            configs = fw._configs()
            for cfg in configs[:1] if first_only else configs:
                yield (f"fp8 wgrad {label} {recipe}", fw._fp8_wgrad_kernel,
                       dict(args, K=K, N=N), consts, cfg, True, False)  # fmt: skip


def fp8_block_gemm_variants(M, D, E, F, first_only):
    """The blockwise recipe's e4m3 GEMM (moe/fp8/triton_block_gemm.py): up / gate (K = d) and
    down (K = F) forward on the weight's [E, N, K] codes, and the dgrads on its [E, K, N] codes
    read as w^T (up and gate's in one launch: TWO): both K-contiguous. Imported here (see
    fp8_variants)."""
    from moe.fp8 import triton_block_gemm as bg

    B = bg.BLOCK
    args = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32",
                out_ptr="*bf16", offsets_ptr="*i32", M=M, E=E, M_BUCKET=triton.next_power_of_2(M),
                stride_ask=1, stride_bk=1, a2_ptr="*fp8e4nv", as2_ptr="*fp32", b2_ptr="*fp8e4nv",
                bs2_ptr="*fp32")  # fmt: skip
    roles = (("up", D, F, False), ("down", F, D, False), ("dgrad up+gate", F, D, True),
             ("dgrad down", D, F, True))  # fmt: skip
    for label, K, N, dgrad in roles:
        # forward: b = q_ENK^T (strides K N, 1, K), scales [E, K/B, N/B]; dgrad: b = q_EKN^T
        # ([E, N, K] view of the [E, K, N] codes: strides K N, 1, N), scales transposed
        kb, nb = K // B, N // B
        strides = dict(stride_am=K, stride_asm=kb, stride_be=K * N, stride_bn=K,
                       stride_se=kb * nb, stride_sk=nb, stride_sn=1)  # fmt: skip
        if dgrad:
            strides.update(stride_sk=1, stride_sn=kb)
        consts = dict(E_POW2=triton.next_power_of_2(E + 1), DECODE=False, RNE_BF16=False,
                      TWO=label == "dgrad up+gate")  # fmt: skip
        configs = bg._configs()
        for cfg in configs[:1] if first_only else configs:
            kargs = dict(args, N=N, K=K, **strides)
            yield f"fp8 block gemm {label}", bg._block_mm_kernel, kargs, consts, cfg, True, False
    yield from _fp8_swiglu_variants(M, D, E, F, first_only)


def _fp8_swiglu_variants(M, D, E, F, first_only):
    """The blockwise up and gate forward with the SwiGLU and the down GEMM's quantization in
    the epilogue (moe/fp8/triton_swiglu_mm.py), bf16 x, with and without row weights."""
    from moe.fp8 import triton_swiglu_mm as sw

    kb, nb = D // sw.BLOCK, F // sw.BLOCK
    args = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32",
                b3_ptr="*fp8e4nv", bs3_ptr="*fp32", h_ptr="*bf16", g_ptr="*bf16",
                q_ptr="*fp8e4nv", qs_ptr="*fp32", w_ptr="*bf16", offsets_ptr="*i32", M=M, N=F,
                K=D, E=E, M_BUCKET=triton.next_power_of_2(M), stride_am=D, stride_asm=kb,
                stride_ask=1, stride_be=D * F, stride_bk=1, stride_bn=D, stride_se=kb * nb,
                stride_sk=nb, stride_sn=1, stride_w=1, floor="fp32")  # fmt: skip
    for row_w in (False, True):
        consts = dict(E_POW2=triton.next_power_of_2(E + 1), ROW_W=row_w, BF16=True, POW2=True,
                      INTERP=False)  # fmt: skip
        configs = sw._configs()
        for cfg in configs[:1] if first_only else configs:
            label = "fp8 block swiglu up+gate" + (" row weights" if row_w else "")
            yield label, sw._swiglu_mm_kernel, args, consts, cfg, True, False


def wgrad_variants(p, probe, M, D, E, F, first_only):
    """dW1 and dW3 in one launch from the pre-permuted x copy (the compiled path), and dW2."""
    red = dict(a_ptr=p, idx_ptr="*i64", b_ptr=p, offsets_ptr="*i32", order_ptr="*i32", out_ptr=p,
               out2_ptr=p, dbias_ptr="*fp32", M=M, I=D, J=F, E=E, M_BUCKET=triton.next_power_of_2(M),
               stride_am=D, stride_bm=2 * F, stride_oe=D * F, stride_oi=F, stride_dbe=F)  # fmt: skip
    dw2 = dict(red, I=F, J=D, stride_am=F, stride_bm=D, stride_oi=D, stride_dbe=D)
    flags = dict(GATHER=False, HAS_DBIAS=False, DOT_F32=False, PRECISION="tf32", GROUP_J=8)
    for label, args, two in (("dW1+dW3 (x pre-permuted)", red, True), ("dW2", dw2, False)):
        consts = dict(flags, TWO_OUT=two)
        configs = wgrad._prune(wgrad._configs(), probe, **consts)
        for cfg in configs[:1] if first_only else configs:
            yield f"wgrad {label}", wgrad._ragged_reduce_kernel, args, consts, cfg, True, False


def misc_variants(p, M, D, T):
    gs = dict(src_ptr=p, rows_ptr="*i64", seg_ptr="*i64", w_ptr="*fp32", out_ptr=p,
              live_ptr="*i32", T=T, D=D, M=M, KF=2, stride_s=D, stride_o=D)  # fmt: skip
    for label, fixed, weighted, live in (("combine fwd", True, True, False),
                                         ("rows_to_tokens", False, False, False),
                                         ("rows_to_tokens (token rows)", True, False, True)):  # fmt: skip
        flags = dict(FIXED_K=fixed, WEIGHTED=weighted, LIVE=live, BLOCK_T=16, BLOCK_D=256)
        yield label, gather_sum._gather_sum_kernel, gs, flags, None, False, False
    cb = dict(dy_ptr=p, out_ptr=p, rows_ptr="*i64", w_ptr="*fp32", dout_ptr=p, dw_ptr="*fp32", T=T,
              D=D, M=M, KF=2, stride_dy=D, stride_out=D, stride_dout=D)  # fmt: skip
    flags = dict(K_POW2=2, BLOCK_T=16, BLOCK_D=256)
    yield "combine bwd", gather_sum._combine_bwd_kernel, cb, flags, None, False, False
    sched = dict(offsets_ptr="*i32", out_ptr="*i32", E=512, M=M)
    consts = dict(BLOCK_M=128, E_POW2=1024)
    yield "schedule (E=512)", schedule._schedule_kernel, sched, consts, None, False, False


def row_variants(p, M, D, F):
    """The row passes beside the GEMMs: the activation recomputed, and the passes the roles on
    CUTLASS need (moe/kernels/triton/cutlass_roles.py)."""
    swiglu = dict(ACT=4, GATED=True, ROW_SCALE=True)
    ar = dict(pre_ptr=p, scale_ptr="*fp32", out_ptr=p, live_ptr="*i32", M=M, F=F,
              stride_pm=2 * F)  # fmt: skip
    yield ("act_rows", activations._act_rows_kernel, ar, dict(swiglu, BLOCK_M=32, BLOCK_F=128),
           None, False, False)  # fmt: skip
    ab = dict(da_ptr=p, pre_ptr=p, scale_ptr="*fp32", dpre_ptr=p, ds_ptr="*fp32",
              live_ptr="*i32", act_ptr=p, M=M, F=F, stride_da=F, stride_pre=2 * F)  # fmt: skip
    yield ("act_bwd_rows", row_passes._act_bwd_rows_kernel, ab,
           dict(swiglu, SAVE_ACT=True, BLOCK_M=16, BLOCK_F=128), None, False, False)  # fmt: skip
    zt = dict(y_ptr=p, live_ptr="*i32", M=M, N=D, stride_m=D)
    consts = dict(BLOCK_M=32, BLOCK_N=128)
    yield "zero_tail_rows", row_passes._zero_tail_kernel, zt, consts, None, False, False


def failures(r: dict, is_gemm: bool, wants_tma: bool, arch: int) -> list[str]:
    """What is wrong with one compiled GEMM variant on sm_90+ (empty: nothing)."""
    if not is_gemm or arch < 90:
        return []
    bad = [] if r["wgmma"] else ["no wgmma"]
    if wants_tma and not r["tma"]:
        bad.append("no TMA")
    if not r["res"]:
        bad.append("no resource usage (cuobjdump missing or unreadable): spills unchecked")
    elif r["res"].get("stack", 0) or r["res"].get("local", 0):
        bad.append(f"spills ({r['res']['stack']} B stack, {r['res'].get('local', 0)} B local)")
    bad += r["unpipelined"]
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {tuple(SHAPES)}")
    parser.add_argument("--first", action="store_true", help="only the first pruned config")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4), help="compilers")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {tuple(SHAPES)}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this check compiles the kernels", file=sys.stderr)
        return 2
    print(f"triton {triton.__version__}, target sm_{args.arch}, {args.dtype}", flush=True)
    shapes = args.shapes.split(",")
    todo = _all_variants(args.dtype, shapes, args.first)
    first_of = {}  # compile key -> index of its first variant: identical compiles run once
    for index, (_, (_label, kernel, kargs, consts, cfg, _, _)) in enumerate(todo):
        first_of.setdefault(_spec(kernel, kargs, consts, cfg)[-1], index)
    jobs = [(args.dtype, shapes, args.first, args.arch, i) for i in first_of.values()]
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max(args.jobs, 1), mp_context=ctx) as pool:
        done = dict(zip(first_of, pool.map(_compile_job, jobs)))
    bad, current = 0, None
    for name, (label, kernel, kargs, consts, cfg, is_gemm, wants_tma) in todo:
        if name != current:
            current = name
            print(f"-- {name} (T, d, E, k, F) = {SHAPES[name]}")
        r = done[_spec(kernel, kargs, consts, cfg)[-1]]
        shape = "" if cfg is None else " ".join(str(v) for v in cfg.kwargs.values())
        shape += "" if cfg is None else f" w{cfg.num_warps}s{cfg.num_stages}"
        res = r["res"]
        regs = f"regs {res['regs']:3d} stack {res['stack']:3d}" if res else "regs ?"
        problems = failures(r, is_gemm, wants_tma, args.arch)
        bad += bool(problems)
        print(f"{label:32s} {shape:18s} wgmma {r['wgmma']!s:5s} tma {r['tma']!s:5s} "
              f"shared {r['shared']:6d} {regs}  {'FAIL: ' + '; '.join(problems) if problems else 'ok'}")  # fmt: skip
    print(f"{len(todo)} variants, {len(jobs)} distinct compiles: ", end="")
    print(f"{bad} failing" if bad else "all GEMM variants pass")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
