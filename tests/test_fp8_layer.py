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
        want = _quantized_input_reference(_layer(None), x, q, dy)
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
    plan = layer._row_map(routing, len(x_TD))
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
        MoEConfig(d_model=8, d_ff=8, num_experts=2, fp8="dispatch")
    with pytest.raises(ValueError, match="fp8: .*unexpected keyword argument 'dispach'"):
        MoEConfig(d_model=8, d_ff=8, num_experts=2, fp8={"dispach": True})
    # one setting chooses the FP8 experts (FP8Config.experts): checked when the layer is built
    with pytest.raises(ValueError, match="backend='torch' asks for another one"):
        moe.MoELayer(8, 8, 2, backend="torch", fp8=FP8Config(experts=True))
    with pytest.raises(
        ValueError,
        match=r"backend='fp8' is chosen by MoEConfig.fp8 = FP8Config\(experts=True\), not by name",
    ):
        moe.MoELayer(8, 8, 2, backend="fp8")
    assert (
        moe.MoELayer(8, 8, 2, backend="fp8", fp8=FP8Config(experts=True))
        .experts.kernel_for(torch.zeros(1))
        .config.experts
    )
    with pytest.raises(ValueError, match="row_format='fp8' is chosen by MoEConfig.fp8"):
        moe.MoELayer(8, 8, 2, row_format="fp8")
    with pytest.raises(ValueError, match="FP8Config.block_size must be an int >= 1"):
        FP8Config(dispatch=True, block_size=0)
    MoEConfig(d_model=8, d_ff=8, num_experts=2, backend="torch", fp8=FP8Config(dispatch=True))
    layer = _layer(FP8Config(experts=True), dtype=torch.float64)
    with pytest.raises(ValueError, match="moe: kernel 'fp8' cannot run this layer: it takes"):
        layer(torch.randn(3, D, dtype=torch.float64))


ALL = FP8Config(dispatch=True, experts=True, grad_before_down_fp8=True, block_size=16)


def test_fp8_layer_meets_recompute_compile_and_router_replay():
    """FP8 (dispatch, experts, combine backward) with recompute equals it without; under
    torch.compile (aot_eager: dynamo + AOT autograd over the fake registrations) equals eager;
    a replayed routing reproduces the recorded forward bit for bit."""
    x, dy = torch.randn(2, 11, D), torch.randn(2, 11, D)
    eager = _run(_layer(ALL), x, dy)
    _close(_run(_layer(ALL, recompute=True), x, dy), eager, rel=0)
    torch._dynamo.reset()
    compiled = torch.compile(_layer(ALL), backend="aot_eager")
    _close(_run(compiled, x, dy), eager)
    layer = _layer(ALL)
    with moe.record_routing(layer) as routes:
        recorded = layer(x)
    with moe.replay_routing(layer, routes):
        assert torch.equal(layer(x), recorded)
    with torch.no_grad():
        layer.router.weight.add_(torch.randn_like(layer.router.weight))  # would route anew
    with moe.record_routing(layer) as again, moe.replay_routing(layer, routes):
        layer(x)
    ((first,),), ((second,),) = routes.layers.values(), again.layers.values()
    assert torch.equal(first.expert_ids_TK, second.expert_ids_TK)


def test_checkpoint_saved_with_fp8_loads_without_and_back(tmp_path):
    """FP8 is not part of the saved weights: the state dict (what checkpoints and HF exports
    read) is the bf16/fp32 masters, equal with FP8 on or off; a checkpoint saved with FP8
    on loads with it off and back on (not refused as a changed layer setting)."""
    from moe.checkpoint import load_checkpoint, save_checkpoint

    def model(fp8, seed=0):
        return torch.nn.Sequential(_layer(fp8, seed=seed, dtype=torch.bfloat16))

    on, off = model(ALL), model(None)
    assert {k: v.dtype for k, v in on.state_dict().items()} == {
        k: v.dtype for k, v in off.state_dict().items()
    }
    assert all(
        torch.equal(a, b) for a, b in zip(on.state_dict().values(), off.state_dict().values())
    )
    opt = torch.optim.AdamW(on.parameters(), lr=1e-2)
    on(torch.randn(5, D, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    save_checkpoint(str(tmp_path / "on"), on, opt)
    twin = model(None, seed=1)
    load_checkpoint(str(tmp_path / "on"), twin, torch.optim.AdamW(twin.parameters(), lr=1e-2))
    for a, b in zip(on.parameters(), twin.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert twin[0].experts.w1.dtype == torch.bfloat16  # the masters, not FP8
    save_checkpoint(str(tmp_path / "off"), twin)
    back = model(ALL, seed=2)
    load_checkpoint(str(tmp_path / "off"), back)
    assert all(torch.equal(a, b) for a, b in zip(on.parameters(), back.parameters()))
    x = torch.randn(4, D, dtype=torch.bfloat16)
    assert torch.equal(back(x), on(x))


class _Counting:
    """An exchange plan that moves nothing and counts the bytes it is given."""

    def __init__(self):
        self.sent = 0

    def run(self, rows):
        self.sent += rows.numel() * rows.element_size()
        return rows

    def reverse(self):
        return self


def test_fp8_wire_bytes_and_one_rounding_with_blockwise_experts():
    """What the dispatch sends, counted at the exchange: <= 0.52x bf16 at d = 7168 (7,392 of
    14,336 bytes per token; ue8m0 7,224). Dispatch then the blockwise GEMM's 1 x 128
    quantization: the same values when both scales are powers of two or both fp32, a second
    rounding when they differ (README, FP8 section)."""
    from moe.dispatch.wire import wire_for
    from moe.fp8.quant import dequantize_blocks, quantize_blocks

    x = torch.randn(6, 7168, dtype=torch.bfloat16)
    sent = {}
    for name, fp8 in (("bf16", None), ("fp32", FP8Config(dispatch=True)),
                      ("ue8m0", FP8Config(dispatch=True, scale_format="ue8m0"))):  # fmt: skip
        plan = _Counting()
        wire_for(MoEConfig(d_model=D, d_ff=D, num_experts=2, fp8=fp8)).dispatch(x, plan)
        sent[name] = plan.sent / 6
    assert sent == {"bf16": 14336, "fp32": 7392, "ue8m0": 7224}
    assert sent["fp32"] / sent["bf16"] <= 0.52
    x = torch.randn(16, 300) * torch.randn(16, 1).exp()
    for scale_format, gemm_pow2, same in (("ue8m0", True, True), ("fp32", False, True),
                                          ("fp32", True, False)):  # fmt: skip
        fp8 = FP8Config(dispatch=True, scale_format=scale_format)
        arrived = wire_for(MoEConfig(d_model=D, d_ff=D, num_experts=2, fp8=fp8)).local_dispatch(x)
        q, s = quantize_blocks(arrived, 128, gemm_pow2)
        assert torch.equal(dequantize_blocks(q, s, 128, torch.float32), arrived) == same


def test_moe_settings_file_keeps_fp8(tmp_path):
    """save_moe_settings / swap_ffn_from_settings round-trip MoEConfig.fp8 (JSON: its fields)."""
    model = torch.nn.Sequential(_layer(ALL))
    moe.save_moe_settings(model, tmp_path)
    moe.check_moe_settings(model, tmp_path)
    from moe.convert.saved_settings import read_moe_settings

    (entry,) = read_moe_settings(tmp_path)
    assert MoEConfig(**entry["config"]).fp8 == ALL
    with pytest.raises(ValueError, match="MoE setting fp8="):
        moe.check_moe_settings(torch.nn.Sequential(_layer(FP8Config(dispatch=True))), tmp_path)
