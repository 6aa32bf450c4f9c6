"""FP8 in the layer (issue 40): MoEConfig.fp8 / MoELayer(fp8=...), the "fp8" expert kernel and
the one-process emulation of the FP8 dispatch, each against a reference that applies the same
quantization; bad settings are one clear error."""

import pytest
import torch

import moe
from moe.config import MoEConfig
from moe.fp8 import FP8Config, FP8Kernel, fp8_expert_mlp
from moe.kernels.expert_rows import ExpertRows
from tests.fp8_reference import ref_blocks

D, F, E = 40, 24, 4  # d_model not a multiple of the 16-element blocks used below


def _layer(fp8, seed=0, **kw):
    torch.manual_seed(seed)
    return moe.MoELayer(D, F, E, top_k=2, activation="swiglu", fp8=fp8, **kw)


def _run(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    return [y, x.grad, *grads]


def _close(got, want, rel=1e-6):
    for g, w in zip(got, want, strict=True):
        g, w = g.detach(), w.detach()
        scale = float(w.abs().max()) + 1e-30
        assert float((g - w).abs().max()) <= rel * scale, float((g - w).abs().max()) / scale


def _quantized_input_reference(layer, x, q, dy):
    """The layer with its router on x and its experts on q (x's rows as the wire delivers
    them): outputs, d/dx (through the router plus straight through q) and parameter grads."""
    x, q = x.detach().clone().requires_grad_(), q.detach().clone().requires_grad_()
    route = layer.router.forward
    layer.router.forward = lambda _x: route(x.reshape(-1, D))
    y = layer(q)
    y.backward(dy)
    return [y, x.grad + q.grad, *[p.grad for p in layer.parameters()]]


def test_fp8_dispatch_in_one_process_is_the_quantized_input():
    """fp8.dispatch on one device = the same layer whose experts read the token rows
    quantized 1 x block (float64 reference quantizer), gradient straight through; fp32 and
    ue8m0 scales."""
    x, dy = torch.randn(3, 7, D) * 3, torch.randn(3, 7, D)
    for fmt, pow2 in (("fp32", False), ("ue8m0", True)):
        fp8 = FP8Config(dispatch=True, block_size=16, scale_format=fmt)
        got = _run(_layer(fp8), x, dy)
        q = ref_blocks(x.reshape(-1, D), 16, pow2).float().view_as(x)
        assert not torch.equal(q, x)  # the quantization changes the input
        want = _quantized_input_reference(_layer(FP8Config(block_size=16)), x, q, dy)
        _close(got, want)


def test_fp8_experts_layer_runs_the_fp8_kernel_with_its_config():
    """fp8.experts: the layer's experts run FP8Kernel holding the layer's FP8Config, and the
    layer equals the combine of fp8_expert_mlp's rows (weights applied after the experts, as
    between ranks)."""
    fp8 = FP8Config(experts=True, recipe="blockwise", gemm_scale_format="fp32")
    layer = _layer(fp8)
    x = torch.randn(2, 9, D)
    y = layer(x)
    assert isinstance(layer.experts.kernel, FP8Kernel) and layer.experts.kernel.config == fp8
    x_TD = x.reshape(-1, D)
    routing = layer.router(x_TD)
    plan = layer._plan(routing, len(x_TD))
    w = layer.experts
    rows_RD = fp8_expert_mlp(
        x_TD, plan.offsets_E, w.w1, w.w2, w.w3, activation="swiglu",
        rows=ExpertRows(gather_ids_R=plan.token_ids_M), config=fp8,
    )  # fmt: skip
    want = torch.zeros_like(x_TD).index_add(
        0, plan.token_ids_M, rows_RD * plan.row_weights()[:, None]
    )
    _close([y.reshape(-1, D)], [want], rel=1e-6)
    plain = _layer(None)(x)  # FP8 changes the result (the test can fail)
    assert not torch.allclose(plain, y, rtol=1e-4, atol=1e-5)


def test_fp8_settings_are_checked():
    with pytest.raises(ValueError, match="fp8 must be FP8Config or None"):
        MoEConfig(d_model=8, d_ff=8, num_experts=2, fp8={"dispatch": True})
    with pytest.raises(ValueError, match="backend='torch' asks for another one"):
        MoEConfig(d_model=8, d_ff=8, num_experts=2, backend="torch", fp8=FP8Config(experts=True))
    with pytest.raises(ValueError, match="FP8Config.block_size must be an int >= 1"):
        FP8Config(dispatch=True, block_size=0)
    MoEConfig(d_model=8, d_ff=8, num_experts=2, backend="torch", fp8=FP8Config(dispatch=True))
    layer = _layer(FP8Config(experts=True), dtype=torch.float64)
    with pytest.raises(ValueError, match="moe: kernel 'fp8' cannot run this layer: it takes"):
        layer(torch.randn(3, D, dtype=torch.float64))
