"""tools/triton_aot_check.py: its readers of ptxas resources and of the TTGIR main loops, and the
facts it reports on real sm_90 compiles (no GPU needed: Triton lowers to cubin on CPU)."""

import os
import subprocess
import sys

import pytest

from tools import triton_aot_check as aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PIPELINED = """
    %a = ttg.local_alloc : () -> !ttg.memdesc<4x128x64xbf16, #shared, #smem, mutable> loc(#loc1)
    %r:3 = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %cst) -> (tensor<128x128xf32>) : i32 {
      %w = ttg.async_wait %t0, %t1 {num = 6 : i32} loc(#loc2)
      %d = ttng.warp_group_dot %x, %y, %acc {inputPrecision = 0 : i32, isAsync = true} : a
      %c = ttg.async_copy_global_to_local %p, %a mask %m {contiguity = 8 : i32} : t loc(#loc3)
      scf.yield %d : tensor<128x128xf32, #mma> loc(#loc4)
    } loc(#loc5)
    %z = ttg.async_wait {num = 0 : i32} loc(#loc6)
"""


def test_reads_pipelined_and_unpipelined_loops():
    assert aot.unpipelined_loops(PIPELINED) == []
    drained = PIPELINED.replace("{num = 6 : i32}", "{num = 0 : i32}")
    assert aot.unpipelined_loops(drained) == [
        "async_wait {num = 0} in the loop (loads drained every iteration)"
    ]
    sync = PIPELINED.replace(
        "%c = ttg.async_copy_global_to_local %p, %a mask %m {contiguity = 8 : i32} : t",
        "%c = tt.load %p, %m : tensor<128x64x!tt.ptr<bf16>, #blocked>",
    )
    assert aot.unpipelined_loops(sync) == ["synchronous tensor load in the loop"]
    scales = sync.replace("tensor<128x64x!tt.ptr<bf16>", "tensor<128x!tt.ptr<f32>")
    assert aot.unpipelined_loops(scales) == []  # a vector (per-row scales), not a tile
    no_dot = drained.replace("ttng.warp_group_dot", "arith.addf")  # not a GEMM loop
    assert aot.unpipelined_loops(no_dot) == []


def test_reads_resources_and_flags_failures():
    text = " Function k:\n  REG:255 STACK:16 SHARED:1024 LOCAL:0 CONSTANT[0]:656 TEXTURE:0"
    res = aot.parse_resources(text)
    assert res == dict(regs=255, stack=16, local=0)
    r = dict(wgmma=True, tma=False, res=res, unpipelined=[])
    assert aot.failures(r, True, False, 90) == ["spills (16 B stack, 0 B local)"]
    r = dict(wgmma=False, tma=False, res=dict(regs=96, stack=0, local=0), unpipelined=["x"])
    assert aot.failures(r, True, True, 90) == ["no wgmma", "no TMA", "x"]
    assert aot.failures(r, False, True, 90) == [] and aot.failures(r, True, True, 80) == []
    r = dict(wgmma=True, tma=True, res={}, unpipelined=[])  # no cuobjdump: cannot pass
    assert aot.failures(r, True, True, 90) == [
        "no resource usage (cuobjdump missing or unreadable): spills unchecked"
    ]


SNIPPET = """
import torch, triton
from triton.backends.compiler import GPUTarget
from tools import triton_aot_check as aot
from moe.kernels.triton import grouped_mm as rows, grouped_mm_wgrad as wgrad
target, cache = GPUTarget("cuda", 90, 32), {}
M, D, E, F = 16384, 4096, 8, 14336
probe = {"a_ptr": torch.empty(0, dtype=torch.bfloat16)}
(label, kernel, args, consts, cfg, _, _), = [
    v for v in aot.wgrad_variants("*bf16", probe, M, D, E, F, True) if "dW1" in v[0]]
for name, gather in (("prepermuted", False), ("gathered", True)):
    r = aot.compile_variant(kernel, args, dict(consts, GATHER=gather), cfg, target, cache)
    print(name + ":", "unpipelined" if r["unpipelined"] else "pipelined", r["unpipelined"])
up = [v for v in aot.variants("bf16", aot.SHAPES["mixtral"], False) if "up swiglu" in v[0]]
(label, kernel, args, consts, cfg, _, _) = up[0]
big = triton.Config(dict(cfg.kwargs, BLOCK_M=128, BLOCK_N=128), num_warps=8, num_stages=4)
r = aot.compile_variant(kernel, args, consts, big, target, cache)
print("up 128x128 w8:", "spills" if r["res"].get("stack") else "no spill", r["res"])
print("kept:", [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in
      rows._prune(rows._configs(), probe, EPILOGUE=1, GATED=True)])
"""


def test_facts_on_real_sm90_compiles():
    """The gathered weight-gradient loop is not pipelined (the old kernel), the pre-permuted one
    is; a SwiGLU `up` 128x128 tile on 8 warps spills, and `_prune` no longer keeps it."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", SNIPPET], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert "gathered: unpipelined" in out and "prepermuted: pipelined" in out, out
    assert "up 128x128 w8: spills" in out, out
    assert "(128, 128, 8)" not in out.split("kept:")[1], out
