"""Triton grouped-GEMM kernels (CUDA; tested under TRITON_INTERPRET=1 on CPU).

Importing this package imports triton: `moe.kernels` loads it lazily, on first use.
"""
