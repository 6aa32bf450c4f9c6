"""FP8Config.wgrad_bf16 (issue 61): the expert MLP's weight-gradient GEMMs take unquantized
operands; the forward and the input gradient are the FP8 path's, bit for bit, and the weight
gradients come closer to the float reference than the FP8 weight gradients."""

import pytest
import torch

import moe
from bench import budget
from moe.fp8 import FP8Config


def _sqnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return (10 * torch.log10(ref.square().sum() / (a.double() - ref).square().sum())).item()


def _run(fp8: FP8Config | None, x: torch.Tensor):
    torch.manual_seed(0)
    layer = moe.MoELayer(64, 48, 4, top_k=2, activation="swiglu", fp8=fp8)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)))
    return y, xg.grad, [layer.experts.w1.grad, layer.experts.w2.grad, layer.experts.w3.grad]


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_bf16_wgrad_keeps_forward_and_dgrad_and_sharpens_dw(recipe):
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(1))
    ref = _run(None, x)
    fp8 = _run(FP8Config(experts=True, recipe=recipe), x)
    hp = _run(FP8Config(experts=True, recipe=recipe, wgrad_bf16=True), x)
    assert torch.equal(hp[0], fp8[0]) and torch.equal(hp[1], fp8[1])
    for w_hp, w_fp8, w_ref in zip(hp[2], fp8[2], ref[2]):
        assert _sqnr(w_hp, w_ref) > _sqnr(w_fp8, w_ref) + 0.5  # dB: the wgrad rounding gone
        assert _sqnr(w_hp, w_ref) > 20


def test_bf16_wgrad_drops_the_wgrad_quantizations():
    """Counted on the CUDA stand-in: none of the weight gradient's operand quantizations. With
    the FP8 weight gradient each gradient's two forms come from one launch (dy, dh, dg) and x
    and the down GEMM's input from one launch each over their kept codes: 10 quantization
    launches in micro-batch 1 (3 of them the weights', once per step); bf16: 8 (no launch for
    x's and the down input's columns)."""
    fp8 = budget.measure("fp8 rowwise", budget.TINY, 1).first
    hp = budget.measure("fp8 rowwise bf16-wgrad", budget.TINY, 1).first
    quant = "triton _quant_kernel"
    assert (fp8.ops[quant], hp.ops[quant]) == (10, 8)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_weight_mm_honours_wgrad_bf16(recipe):
    """FP8Kernel.weight_mm (moe.lora's base GEMMs on the FP8 kernel) takes wgrad_bf16 too: the
    same output and input gradient, and w's gradient the plain grouped GEMM of x as kept
    (e4m3-rounded) and dy, where the FP8 weight gradient differs."""
    from moe.fp8 import FP8Kernel
    from moe.fp8.grouped_mm import kept_input, quantize_input
    from moe.kernels.torch_grouped_mm import wgrad_groups

    g = torch.Generator().manual_seed(5)
    x = torch.randn(23, 40, generator=g)
    w = torch.randn(3, 40, 24, generator=g)
    dy = torch.randn(23, 24, generator=g)
    offsets = torch.tensor([9, 9, 20], dtype=torch.int32)
    out = {}
    for bf16 in (False, True):
        kernel = FP8Kernel("fp8", config=FP8Config(experts=True, recipe=recipe, wgrad_bf16=bf16))
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = kernel.weight_mm(xg, wg, offsets)
        y.backward(dy)
        out[bf16] = (y, xg.grad, wg.grad)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    floor = FP8Config(experts=True).amax_floor
    x_kept = kept_input(quantize_input(x, True, floor, recipe), recipe)
    assert torch.equal(out[True][2], wgrad_groups(x_kept, dy, offsets))
    assert not torch.equal(out[True][2], out[False][2])
