"""FP8 dispatch rows entering the FP8 expert GEMMs as they arrived (moe/fp8/rows.py, issue 61):
the codes and scales where the recipes agree (their values those of quantizing the decoded
rows, bit for bit), else one requantizing launch (moe/fp8/triton_requant.py, run in Triton's
interpreter: the same codes and scales as quantizing the decoded rows); every other op sees the
decoded rows; a layer computes today's values (the rows decoded on arrival) bit for bit under
recompute, LoRA, gradient accumulation and checkpoint reload, in float32, bf16 and float16."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import moe  # noqa: E402
from moe.dispatch.wire import RowWire  # noqa: E402
from moe.fp8 import FP8Config  # noqa: E402
from moe.fp8.blockwise import saved_x  # noqa: E402
from moe.fp8.grouped_mm import quantize_input  # noqa: E402
from moe.fp8.quant import AMAX_FLOOR  # noqa: E402
from moe.fp8.rows import QuantizedRows, gemm_input  # noqa: E402
from moe.fp8.triton_requant import requantize_triton  # noqa: E402
from moe.fp8.wire import FP8Rows  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, else interpreted


def _rows(dtype, D, seed=0):
    """Random rows from 1e-30 to 1e30, and zero, tiny, largest-finite, Inf and NaN rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, D, generator=g) * torch.logspace(-30, 30, 12).unsqueeze(1)
    x = x.clamp(-1e38, 1e38).to(dtype)
    x[1], x[2, 5], x[3, 9], x[4] = 0, float("inf"), float("nan"), 1e-40
    x[5], x[6, :3] = torch.finfo(dtype).max, -torch.finfo(dtype).max
    return x


def _arrived(x, fp8: FP8Config) -> QuantizedRows:
    """x's rows as the dispatch delivers them to FP8 experts."""
    fmt = FP8Rows("fp8", fp8, to_experts=True)
    return fmt.decode(fmt.encode(x), x.shape[1], x.dtype)


def _same(a, b) -> bool:
    """Bit for bit, NaN equal to NaN (a NaN's sign is no device's promise); uint8: e4m3 codes."""
    if a.dtype == torch.uint8:
        a, b = a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn)
    nan = a.float().isnan()

    def bits(t):
        return t.contiguous().view(torch.uint8).view(*t.shape, t.element_size())[~nan]

    return (
        a.shape == b.shape and torch.equal(nan, b.float().isnan()) and torch.equal(bits(a), bits(b))
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_agreeing_rows_enter_as_they_arrived_with_the_decoded_rows_values(dtype):
    """Blockwise, block 128, power-of-two scales both sides: the GEMM takes the codes and
    scales that arrived, and they dequantize to what quantizing the decoded rows gives."""
    for scale_format in ("pow2", "ue8m0"):
        for D in (256, 200):  # (200: a partial last block)
            fp8 = FP8Config(dispatch=True, experts=True, recipe="blockwise",
                            scale_format=scale_format)  # fmt: skip
            x = _arrived(_rows(dtype, D), fp8)
            q, s = gemm_input(x, True, AMAX_FLOOR, "blockwise")
            assert q.data_ptr() == x.codes.data_ptr() or torch.equal(q, x.codes)
            assert _same(s, x.scales)
            q_ref, s_ref = quantize_input(x.dequantize(), True, AMAX_FLOOR, "blockwise")
            assert _same(saved_x(q, s), saved_x(q_ref, s_ref)), (scale_format, D)


@pytest.mark.parametrize("dtype", DTYPES)
def test_requantize_in_one_launch_equals_quantizing_the_decoded_rows(dtype):
    """Rowwise, or scales that disagree: one launch from the codes gives the codes and scales
    of quantizing the decoded rows (rounded to their dtype, float16 saturated), bit for bit."""
    for scale_format in ("fp32", "pow2", "ue8m0"):
        for recipe, block in (("rowwise", 32), ("blockwise", 128), ("blockwise", 64)):
            for pow2 in (True, False):
                fp8 = FP8Config(dispatch=True, experts=True, scale_format=scale_format,
                                block_size=block)  # fmt: skip
                x = _arrived(_rows(dtype, 256), fp8)
                ids = torch.tensor([5, 0, 11, 3, 3, 2, 9, 4, 1])  # (a permutation, repeats)
                width = 256 if recipe == "rowwise" else 128
                q, s = requantize_triton(x.codes.to(DEV), x.scales.to(DEV), block, dtype,
                                         width, pow2, AMAX_FLOOR, ids.to(DEV))  # fmt: skip
                q_ref, s_ref = quantize_input(x.dequantize()[ids], pow2, AMAX_FLOOR, recipe)
                case = (scale_format, recipe, block, pow2)
                assert _same(q.cpu(), q_ref) and _same(s.cpu(), s_ref), case


@pytest.mark.parametrize("dtype", DTYPES)
def test_payload_in_one_launch_is_the_packed_payload(dtype):
    """The dispatch payload written by one launch: pack_rows(quantize_payload(x)) byte for
    byte (NaN codes: NaN), every scale format, partial and whole-row blocks."""
    from moe.fp8.payload import pack_rows, quantize_payload
    from moe.fp8.triton_payload import fits, payload_triton

    for scale_format in ("fp32", "pow2", "ue8m0"):
        for D, block in ((256, 128), (200, 128), (40, 16), (40, 128), (37, 16)):
            x = _rows(dtype, D)
            x[4] = 1e-37  # (Triton's interpreter misreads bf16 subnormals: 1e-38 as 8.3e-39)
            assert fits(x, block)
            got = payload_triton(x.to(DEV), block, scale_format, AMAX_FLOOR).cpu()
            want = pack_rows(*quantize_payload(x, block, scale_format), scale_format)
            nan = torch.zeros_like(want, dtype=torch.bool)
            nan[:, :D] = want[:, :D].view(torch.float8_e4m3fn).float().isnan()
            case = (scale_format, D, block)
            assert torch.equal(got[~nan], want[~nan]), case
            assert got[:, :D].view(torch.float8_e4m3fn).float().isnan().equal(nan[:, :D]), case


def test_row_moves_keep_codes_and_every_other_op_sees_the_decoded_rows():
    fp8 = FP8Config(dispatch=True, experts=True, block_size=16)
    x = _arrived(torch.randn(7, 40), fp8)
    plain = x.dequantize()
    ids = torch.tensor([3, 0, 6, 3])
    moved = {
        "index_select": (x.index_select(0, ids), plain.index_select(0, ids)),
        "index_select twice, then a slice": (
            x.index_select(0, ids).index_select(0, torch.tensor([2, 0, 1]))[1:],
            plain.index_select(0, ids).index_select(0, torch.tensor([2, 0, 1]))[1:],
        ),
        "cat of read rows": (torch.cat([x[ids], x]), torch.cat([plain[ids], plain])),
        "slice": (x[2:5], plain[2:5]),
        "cat": (torch.cat([x, x[:2]]), torch.cat([plain, plain[:2]])),
        "split": (torch.split(x, [3, 4])[1], torch.split(plain, [3, 4])[1]),
        "detach": (x.detach(), plain),
        "clone": (x.clone(), plain),
    }
    for name, (got, want) in moved.items():
        assert isinstance(got, QuantizedRows), name
        assert torch.equal(got.dequantize(), want), name
    w = torch.randn(40, 3)
    for got, want in ((x * 2, plain * 2), (x @ w, plain @ w), (x.double(), plain.double())):
        assert type(got) is torch.Tensor and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="writes into FP8 dispatch rows"):
        x.add_(1)
    # gradients come back plain, straight through the format (the wire's rule)
    src = torch.randn(7, 40, requires_grad=True)
    rows = RowWire(dispatch_format=FP8Rows("fp8", fp8, to_experts=True)).local_dispatch(src)
    assert isinstance(rows, QuantizedRows) and rows.requires_grad
    (rows.index_select(0, ids) * w.sum(1)[:4, None]).sum().backward()
    want = torch.zeros(7, 40).index_add_(0, ids, w.sum(1)[:4, None].expand(4, 40))
    assert torch.equal(src.grad, want)


def _decoded_on_arrival(layer):
    """The layer with the rows decoded on arrival (today's path before QuantizedRows)."""
    wire = layer.dispatcher.wire
    fmt = dataclasses.replace(wire.dispatch_format, to_experts=False)
    layer.dispatcher.wire = dataclasses.replace(wire, dispatch_format=fmt)
    return layer


def _train(layer, x, micro):
    """Two steps of `micro` micro-batches: outputs, every gradient, then the parameters."""
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    seen = []
    for _ in range(2):
        for xs in x.tensor_split(micro):
            xs = xs.clone().requires_grad_()
            y = layer(xs)
            y.float().square().sum().backward()
            seen += [y.detach(), xs.grad]
        seen += [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
    return seen + [p.detach().clone() for p in layer.parameters()]


CASES = {  # name -> (FP8Config options, layer options, micro-batches, LoRA)
    "rowwise (requantized)": (dict(block_size=16), {}, 2, False),
    "blockwise pow2 (as arrived)": (dict(recipe="blockwise", scale_format="pow2"), {}, 1, False),
    "blockwise ue8m0, recompute": (
        dict(recipe="blockwise", scale_format="ue8m0", save_fp8_inputs=False),
        {"recompute": True},
        2,
        False,
    ),  # fmt: skip
    "rowwise, LoRA": (dict(block_size=16), {}, 1, True),
    "blockwise pow2, LoRA, recompute": (
        dict(recipe="blockwise", scale_format="pow2"),
        {"recompute": True},
        1,
        True,
    ),  # fmt: skip
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_equals_the_rows_decoded_on_arrival(dtype):
    """Outputs, input and parameter gradients and parameters after two AdamW steps equal,
    bit for bit, the layer whose dispatched rows are decoded on arrival; the rows reach the
    expert kernel as QuantizedRows."""
    from moe.lora import LoRAConfig, add_lora

    x = torch.randn(18, 32, generator=torch.Generator().manual_seed(3)).to(dtype) * 3
    for name, (options, layer_options, micro, lora) in CASES.items():
        fp8 = FP8Config(dispatch=True, experts=True, grad_before_down_fp8=True, **options)
        runs = []
        for decoded in (False, True):
            torch.manual_seed(0)
            layer = moe.MoELayer(32, 24, 4, top_k=2, activation="swiglu", fp8=fp8,
                                 dtype=dtype, **layer_options)  # fmt: skip
            if lora:
                add_lora(layer, LoRAConfig(rank=2, alpha=2.0))
                with torch.no_grad():
                    for n, p in layer.named_parameters():
                        if "lora_B" in n:
                            p.copy_(torch.randn_like(p))
            runs.append(_train(_decoded_on_arrival(layer) if decoded else layer, x, micro))
        for got, want in zip(*runs, strict=True):
            assert _same(got, want), name


def test_the_rows_reach_the_expert_kernel_quantized(monkeypatch):
    """No decode between the wire and the GEMM: gemm_input gets QuantizedRows and nothing
    dequantizes them (blockwise pow2: the codes as they arrived)."""
    import moe.fp8.expert_mlp_fn as fn

    seen = []
    monkeypatch.setattr(fn, "gemm_input", lambda x, *a: seen.append(type(x)) or gemm_input(x, *a))
    monkeypatch.setattr(QuantizedRows, "dequantize", lambda self: pytest.fail("decoded"))
    fp8 = FP8Config(dispatch=True, experts=True, recipe="blockwise", scale_format="pow2")
    layer = moe.MoELayer(32, 24, 4, top_k=2, activation="swiglu", fp8=fp8)
    layer(torch.randn(9, 32, requires_grad=True)).sum().backward()
    assert seen == [QuantizedRows]


def test_other_consumers_decode_the_rows_once(monkeypatch):
    """A LoRA-adapted FP8 kernel reads the rows in several ops (base GEMMs, adapters, their
    backward): they share one decode, as they shared the rows decoded on arrival."""
    import moe.fp8.rows as rows
    from moe.lora import LoRAConfig, add_lora

    decodes = []
    real = rows.dequantize_payload
    monkeypatch.setattr(rows, "dequantize_payload", lambda *a: decodes.append(1) or real(*a))
    fp8 = FP8Config(dispatch=True, experts=True, block_size=16)
    layer = moe.MoELayer(32, 24, 4, top_k=2, activation="swiglu", fp8=fp8)
    add_lora(layer, LoRAConfig(rank=2, alpha=2.0))
    layer(torch.randn(9, 32, requires_grad=True)).sum().backward()
    assert len(decodes) == 1


def test_checkpoint_reload_continues_the_same(tmp_path):
    """A checkpoint saved mid-training and loaded into a fresh layer continues bit for bit."""
    from moe.checkpoint import load_checkpoint, save_checkpoint

    fp8 = FP8Config(dispatch=True, experts=True, recipe="blockwise", scale_format="ue8m0")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(moe.MoELayer(32, 24, 4, top_k=2, activation="swiglu",
                                                fp8=fp8, dtype=torch.bfloat16))  # fmt: skip

    x = torch.randn(10, 32, dtype=torch.bfloat16)
    a = model()
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    a(x).float().square().sum().backward()
    opt.step()
    save_checkpoint(str(tmp_path / "ck"), a, opt)
    b = model()
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    load_checkpoint(str(tmp_path / "ck"), b, opt_b)
    for m, o in ((a, opt), (b, opt_b)):  # one more step each: the same
        o.zero_grad()
        m(x).float().square().sum().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.equal(a(x), b(x))
