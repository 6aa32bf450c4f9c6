"""The one tl.dot wrapper every grouped-GEMM kernel uses (fp32 accumulation).

Under TRITON_INTERPRET=1, tl.dot on bf16 operands is wrong (docs/notes.md), so the host sets
DOT_F32 there and the tiles are upcast to fp32 first; compiled kernels take the other branch and
feed bf16/fp16 tiles straight to the tensor cores. Same kernel code on both.
"""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc
