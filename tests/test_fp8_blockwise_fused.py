"""The blockwise recipe's one-launch operands (moe/fp8/triton_blocks.py, the CUDA path of
moe/fp8/blockwise.py, issue 61), run in Triton's interpreter on CPU: the weight's 128 x 128
blocks, the weight gradient's tile groups and the codes' values against the eager quantizers
bit for bit, and the expert MLP through the fused path against the eager chain."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from moe.fp8 import quant as Q  # noqa: E402
from moe.fp8.triton_blocks import (  # noqa: E402
    dequantize_triton,
    tile_ends,
    weight_blocks_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_weight_blocks_as_the_eager_quantizer():
    """Codes, one scale per 128 x 128 block (partial blocks at both edges) and the codes
    transposed ([E, N, K]: the forward GEMM's K-contiguous operand); a block holding Inf is
    non-finite, a zero block stays zero, a block of tiny values keeps e4m3's precision."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 200, 136, generator=g).bfloat16()
    w[0, 5, 7] = float("inf")
    w[0, 128:, :128] = 0
    w[0, 128:, 128:] *= 1e-30
    q, s, qt = weight_blocks_triton(w.to(DEV), 128, True, Q.AMAX_FLOOR)
    q_ref, s_ref = Q.quantize_weight_blocks(w, 128, True, Q.AMAX_FLOOR)
    finite = s_ref.isfinite()
    assert torch.equal(s.cpu().nan_to_num(), s_ref.nan_to_num())
    live = Q.expand_weight_blocks(finite, 200, 136, 128)  # (Inf block: codes +-0 / NaN)
    assert torch.equal(q.cpu().float()[live], q_ref.float()[live])
    assert torch.equal(qt.cpu().view(torch.uint8), q.cpu().view(torch.uint8).transpose(1, 2))
    v = Q.dequantize(q.cpu(), Q.expand_weight_blocks(s.cpu(), 200, 136, 128)).double()
    assert v[~live].isnan().any() and (v[0, 128:, :128] == 0).all()
    tiny = w[0, 128:, 128:].double()
    rel = ((v[0, 128:, 128:] - tiny).norm() / tiny.norm()).item()
    assert rel < 2**-4


def test_tile_ends_are_the_row_tiles():
    """Each expert's rows cut into 128-row tiles (last partial, empty experts none), then the
    last offset repeated: the same segments as quant.row_tiles."""
    offsets = torch.tensor([0, 300, 300, 429, 700], dtype=torch.int32)
    M = 750  # 50 tail rows
    ends = tile_ends(offsets.to(DEV), M, 128).cpu()
    seg, S = Q.row_tiles(offsets, M, 128)
    assert ends.shape == (M // 128 + 5 + 1,)
    rows = torch.arange(M)
    got = torch.searchsorted(ends, rows.int(), right=True)
    live = rows < 700
    assert torch.equal(got[live], seg[live]) and (got[~live] == ends.shape[0]).all()


def test_dequantize_blocks_in_one_launch():
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(1)) * 5
    q, s = Q.quantize_blocks(x, 128, True, Q.AMAX_FLOOR)
    got = dequantize_triton(q.to(DEV), s.to(DEV), torch.bfloat16).cpu()
    assert torch.equal(got, Q.dequantize_blocks(q, s, 128, torch.bfloat16))
    from moe.fp8.payload import pack_rows, unpack_rows  # the dispatch payload's packed rows

    q_p, s_p = unpack_rows(pack_rows(q.view(torch.uint8), s, "ue8m0").to(DEV), 256, "ue8m0")
    assert q_p.stride(0) == 256 + 2  # the codes read in place from the packed rows
    got = dequantize_triton(q_p, s_p, torch.float32).cpu()
    assert torch.equal(got, Q.dequantize_blocks(q, s, 128, torch.float32))


@pytest.mark.parametrize("row_w", [False, True])
def test_expert_mlp_through_the_fused_blockwise_path(monkeypatch, row_w):
    """The FP8 expert MLP, blockwise, with every operand from the one-launch kernels (the CUDA
    path, interpreted here; the up and gate GEMMs with the SwiGLU, the row weights and the down
    GEMM's quantization in their epilogue): the eager chain's output and gradients (the same
    e4m3 values and products; the row weights' too); x's gradient to bf16's rounding of the
    sums: the fused dh @ w1^T + dg @ w3^T is one float32 sum rounded once, the eager chain's
    two bf16 parts summed into the tokens."""
    from moe.fp8 import FP8Config, blockwise, fp8_expert_mlp, operands
    from moe.kernels.expert_rows import ExpertRows

    g = torch.Generator().manual_seed(3)
    T, D, F, E = 40, 128, 128, 2
    x = torch.randn(T, D, generator=g).bfloat16()
    ws = [torch.randn(E, *s, generator=g).bfloat16() * 0.1 for s in ((D, F), (F, D), (D, F))]
    ids = torch.randint(0, T, (140,), generator=g)
    offsets = torch.tensor([0, 131], dtype=torch.int32)  # an empty expert, > 1 tile, a tail
    rw = torch.rand(140, generator=g) if row_w else None
    cfg = FP8Config(experts=True, recipe="blockwise")

    def run(fused):
        monkeypatch.setattr(operands, "one_launch", lambda t, op: fused and op[1])
        monkeypatch.setattr(
            blockwise, "fused", lambda t, w, pow2: fused and pow2 and w.shape[1] % 128 == 0
        )
        leaves = [t.to(DEV, copy=True).requires_grad_() for t in (x, *ws, rw) if t is not None]
        rows = ExpertRows(gather_ids_R=ids.to(DEV), row_weights_R=leaves[4] if row_w else None)
        y = fp8_expert_mlp(leaves[0], offsets.to(DEV), *leaves[1:4], activation="swiglu",
                           rows=rows, config=cfg)  # fmt: skip
        y.float().square().sum().backward()
        return [y.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves]

    calls, epilogue = [], blockwise.up_gate_swiglu
    monkeypatch.setattr(blockwise, "up_gate_swiglu", lambda *a: calls.append(1) or epilogue(*a))
    fused, eager = run(True), run(False)
    assert calls == [1]  # the epilogue ran in the fused run only
    for i, (got, want) in enumerate(zip(fused, eager)):
        if i == 1:  # dx
            assert (got - want).norm() <= 2**-7 * want.norm()
            assert (got - want).abs().max() <= 2**-7 * want.abs().max()
        else:
            assert torch.allclose(got, want, rtol=2**-7, atol=1e-5), (got - want).abs().max()


def test_fused_blockwise_budget_on_the_cuda_path():
    """Counted on the CUDA stand-in at widths of 128 (bench.budget; the tiny budget shape's
    widths take the eager fallback): the fused kernels run (the forward and dgrad GEMMs on e4m3
    codes, no dequantized operand), none of the eager chains' ops, each weight quantized once
    per step (its codes in both orientations), launches per micro-batch within the bf16 layer's
    + 12."""
    from bench import budget
    from bench.titan_style import Shape

    s = Shape("tiny128", 64, 128, 4, 2, 256)
    fp8, ref = (budget.measure(v, s, 2) for v in ("fp8 blockwise", "bf16 torch"))
    ops = fp8.first.ops
    # (the down forward, the down dgrad, the up and gate dgrads in one launch; the up and gate
    # forwards with the SwiGLU and the down GEMM's quantization in one launch)
    assert ops["triton _weight_blocks_kernel"] == 3 and ops["triton _block_mm_kernel"] == 3
    assert ops["triton _swiglu_mm_kernel"] == 1
    assert "triton _dequantize_kernel" not in ops and fp8.first.fp8_flops > 0
    assert not {"segment_reduce", "repeat_interleave", "frexp", "amax"} & set(ops)
    assert fp8.weight_casts == 6
    assert budget.per_micro_batch(fp8)[0] <= budget.per_micro_batch(ref)[0] + 12
