"""Tolerances from a dtype's rounding, relative to the values' scale (issue 49 item 22).

A bf16 result differs from its float64 reference by rounding: each rounding is at most half
an ulp, eps/2 relative (bf16: eps = 2**-7), and a layer's few roundings in a row (input,
weights, the hidden activations, the output, each accumulated in fp32) leave errors of about
one eps of the values' largest magnitude (measured: 0.3 to 1.4 eps on outputs and gradients).
`ulps` eps of the largest reference value bounds that with room, while a 10 % error (about
13 bf16 eps) fails.
"""

import torch


def assert_close_in(dtype: torch.dtype, actual, expected, ulps: float = 4.0, msg: str = "") -> None:
    """Every element of `actual` within ulps * eps(dtype) * max|expected| of `expected`
    (compared in float64)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    scale = expected.abs().max().item()
    assert scale > 0, f"{msg}: the reference is all zeros, no scale to compare against"
    bound = ulps * torch.finfo(dtype).eps * scale
    error = (actual - expected).abs().max().item()
    assert error <= bound, (
        f"{msg}: max error {error:.3g} = {error / scale / torch.finfo(dtype).eps:.2f} {dtype} "
        f"eps of the values' scale {scale:.3g}; allowed {ulps} eps ({bound:.3g})"
    )
