"""Replacements for the triton.language helpers that are themselves @triton.jit functions.

tl.cdiv, tl.sum, tl.max, tl.cumsum, tl.sigmoid and tl.zeros are decorated when triton is first
imported, in that moment's mode: if triton was imported before TRITON_INTERPRET=1 was set (any
earlier import of torch._dynamo or a test module does that), the interpreter cannot call them.
These equivalents use tl builtins only and are re-decorated with our kernels
(`triton_common.ensure_mode`), so the kernels work whatever the import order. The reductions
pass triton's own combine functions, which the interpreter recognises (numpy fast path) and
never calls, and which the compiler inlines exactly as tl.sum / tl.max / tl.cumsum do.
"""

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

from moe.kernels.triton.common import interpreting

BUILT_INTERPRETED = interpreting()


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def vsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _sum_combine)


@triton.jit
def vmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _elementwise_max)


@triton.jit
def vcumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, _sum_combine)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))
