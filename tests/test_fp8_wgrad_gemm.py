"""The FP8 weight-gradient grouped GEMM (moe/fp8/triton_wgrad_gemm.py, issue 61) and its
operands (moe/fp8/triton_quant.py's padded column codes), run in Triton's interpreter on CPU
(compiled on a GPU): the eager quantizers' codes and scales, the GEMM against float64 for both
recipes' scaling groups (empty experts, partial 128-row tiles, tail rows, widths that are no
multiple of the block, Inf / NaN columns), and the FP8 expert MLP on the CUDA path against the
eager chain, every gradient."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from moe.fp8 import quant as Q  # noqa: E402
from moe.fp8.triton_wgrad_gemm import column_codes, fp8_wgrad_gemm, scaling_groups  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, else interpreted
FLOOR = Q.AMAX_FLOOR
RECIPES = ("rowwise", "blockwise")


def _input(M, K, seed, specials=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 2, K)  # columns of unlike size
    x[20:30] *= 1e-25  # a stretch of tiny values (gradients far down)
    x[140:150] *= 300  # expert 2's second 128-row tile far larger than its first
    if specials:
        x[5, 3], x[40, 1], x[180, 0] = float("inf"), float("nan"), -float("inf")
    return x


# an empty expert, one of 2 tiles (128 + 12 rows), one of 3 rows, one of 37; 10 tail rows
OFFSETS = torch.tensor([10, 10, 150, 153, 190], dtype=torch.int32)


def unpad(qc, offsets, M):
    """The padded layout [K, W] read back as [M, K] codes (tail rows zero); checks the zeros
    after each expert's rows up to a multiple of 16."""
    codes = qc.cpu().view(torch.uint8)
    out = torch.zeros(M, codes.shape[0], dtype=torch.uint8)
    at, start = 0, 0
    for end in offsets.tolist():
        n = end - start
        out[start:end] = codes[:, at : at + n].t()
        assert (codes[:, at + n : at + -(-n // 16) * 16] == 0).all()
        at, start = at + -(-n // 16) * 16, end
    return out.view(torch.float8_e4m3fn)


def eager(x, offsets, recipe, pow2):
    """The eager chain's (codes [M, K], scales [G, K], group of each row)."""
    if recipe == "rowwise":
        q, s = Q.quantize_groups(x, offsets, pow2, FLOOR)
        return q, s, Q.group_of_rows(offsets, x.shape[0]).long()
    q, s, seg = Q.quantize_row_tiles(x, offsets, 128, pow2, FLOOR)
    return q, s[:-1], seg  # (the last segment: the tail's)


def _same_codes(a, b):
    """Bit for bit, but +-0 alike (a column scaled by Inf: the eager clamp signs its zeros
    otherwise; both dequantize to NaN) and NaN alike."""
    a, b = a.float(), b.float()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_column_codes_as_the_eager_quantizer(recipe, dtype):
    """One launch writes each column's codes scaled within each group (the experts' rows, or
    their 128-row tiles) into the padded transposed layout, with rows + row scales beside
    them (rowwise): the eager quantizers' codes and scales."""
    x = _input(200, 37, seed=1).to(dtype)
    groups = scaling_groups(OFFSETS, 200, recipe)
    q, s, qc, sc = column_codes(x.to(DEV), groups.to(DEV), OFFSETS.to(DEV), True, FLOOR,
                                rows=True)  # fmt: skip
    q_ref, s_ref, _ = eager(x, OFFSETS, recipe, True)
    assert qc.shape == (37, 16 * (-(-200 // 16) + 5)) and sc.shape == s_ref.shape
    assert _same_codes(unpad(qc, OFFSETS, 200), q_ref)
    assert torch.equal(sc.cpu().nan_to_num(), s_ref.nan_to_num())
    q_rows, s_rows = Q.quantize_along(x, -1, True, FLOOR)
    assert _same_codes(q.cpu(), q_rows) and torch.equal(s.cpu().nan_to_num(), s_rows.nan_to_num())


@pytest.mark.parametrize("recipe", RECIPES)
def test_padded_column_codes_of_gathered_kept_codes(recipe):
    """x from a forward's kept codes (rows gathered through token ids, dequantized with their
    row or 1 x 128 scales on load), then quantized per column in the same launch: the eager
    gather -> dequantize -> quantize per group or tile."""
    x = _input(90, 256, seed=2, specials=False)
    ids = torch.randint(0, 90, (200,), generator=torch.Generator().manual_seed(3))
    if recipe == "rowwise":
        q, s = Q.quantize_along(x, -1, True, FLOOR)
        rows = Q.dequantize(q[ids], s[ids])
    else:
        q, s = Q.quantize_blocks(x, 128, True, FLOOR)
        rows = Q.dequantize_blocks(q[ids], s[ids], 128)
    groups = scaling_groups(OFFSETS, 200, recipe)
    qc, sc = column_codes(q.to(DEV), groups.to(DEV), OFFSETS.to(DEV), True, FLOOR,
                          ids=ids.to(DEV), row_scales=s.to(DEV),
                          scale_block=256 if recipe == "rowwise" else 128)  # fmt: skip
    q_ref, s_ref, _ = eager(rows, OFFSETS, recipe, True)
    assert _same_codes(unpad(qc, OFFSETS, 200), q_ref) and torch.equal(sc.cpu(), s_ref)


def _reference(x, dy, offsets, recipe, pow2):
    """float64 dw[e] = sum of e's rows of (codes x scales) x (codes x scales), the eager
    chain's e4m3 operands; and |x|^T |dy| per entry (the size of the sums' rounding)."""
    vals = []
    for t in (x, dy):
        q, s, group = eager(t, offsets, recipe, pow2)
        s = torch.cat([s, torch.zeros(1, s.shape[1])])  # tail rows: zero
        vals.append(q.double() * s.double()[group.clamp(max=s.shape[0] - 1)])
    ends = offsets.tolist()
    ref, size = [], []
    for start, end in zip([0] + ends[:-1], ends):
        a, b = vals[0][start:end], vals[1][start:end]
        ref.append(a.t() @ b)
        size.append(a.abs().t() @ b.abs())
    return torch.stack(ref), torch.stack(size)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_gemm_against_float64(recipe, pow2):
    """dw from the codes and per-group scales, float32 accumulation, each group's partial
    scaled before it is added: the float64 sum of the eager chain's e4m3 products within
    float32 summation error; NaN exactly where a group's column holds Inf or NaN; empty
    experts zero; K = 37 and N = 20 (no multiple of any tile); the weight's dtype out."""
    x, dy = _input(200, 37, seed=4), _input(200, 20, seed=5, specials=False)
    groups = scaling_groups(OFFSETS, 200, recipe).to(DEV)
    a = column_codes(x.to(DEV), groups, OFFSETS.to(DEV), pow2, FLOOR)
    b = column_codes(dy.to(DEV), groups, OFFSETS.to(DEV), pow2, FLOOR)
    dw = fp8_wgrad_gemm(a, b, OFFSETS.to(DEV), 200, recipe, torch.float32).cpu()
    ref, size = _reference(x, dy, OFFSETS, recipe, pow2)
    assert dw.shape == (5, 37, 20) and dw.dtype == torch.float32
    assert torch.equal(dw.isnan(), ref.isnan()) and dw[:, 1].isnan().all(1)[1:3].tolist() == [
        False,
        True,
    ]  # expert 2 holds x[40, 1] = NaN, the empty expert 1 none
    live = ~ref.isnan()
    assert (dw[live].double() - ref[live]).abs().le(2**-18 * size[live] + 1e-300).all()
    assert (dw[1] == 0).all()  # the empty expert
    dw16 = fp8_wgrad_gemm(a, b, OFFSETS.to(DEV), 200, recipe, torch.bfloat16).cpu()
    assert torch.equal(dw16.float().nan_to_num(), dw.bfloat16().float().nan_to_num())


def test_one_expert_and_no_rows():
    """One expert holding every row (no tail; K = 150: more row tiles than a sweep group of
    the kernel's tile order); no live rows at all; no rows: zeros."""
    x, dy = _input(140, 150, seed=6, specials=False), _input(140, 16, seed=7, specials=False)
    for recipe in RECIPES:
        for offsets in (torch.tensor([140], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)):
            groups = scaling_groups(offsets, 140, recipe).to(DEV)
            a = column_codes(x.to(DEV), groups, offsets.to(DEV), True, FLOOR)
            b = column_codes(dy.to(DEV), groups, offsets.to(DEV), True, FLOOR)
            dw = fp8_wgrad_gemm(a, b, offsets.to(DEV), 140, recipe, torch.float32).cpu()
            ref, size = _reference(x, dy, offsets, recipe, True)
            assert (dw.double() - ref).abs().le(2**-18 * size + 1e-300).all()
        none = torch.tensor([0, 0], dtype=torch.int32)
        a = column_codes(x[:0].to(DEV), none.to(DEV), none.to(DEV), True, FLOOR)
        dw = fp8_wgrad_gemm(a, a, none.to(DEV), 0, recipe, torch.float32)
        assert dw.shape == (2, 150, 150) and (dw == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_expert_mlp_on_the_cuda_path_against_the_eager_chain(monkeypatch, recipe):
    """The FP8 expert MLP with its weight gradients from the one-launch operands and this GEMM
    (the CUDA path, interpreted here) against the eager chain (quantize, dequantize, float32
    GEMM): output and every gradient within float32 summation error, float32 throughout."""
    from moe.fp8 import FP8Config, fp8_expert_mlp, operands
    from moe.kernels.expert_rows import ExpertRows

    g = torch.Generator().manual_seed(8)
    T, D, F = 60, 24, 40
    x = torch.randn(T, D, generator=g)
    ws = [torch.randn(4, *s, generator=g) * 0.3 for s in ((D, F), (F, D), (D, F))]
    ids = torch.randint(0, T, (200,), generator=g)
    offsets = torch.tensor([0, 140, 143, 190], dtype=torch.int32)  # empty, 2 tiles, 3, 47; tail
    cfg = FP8Config(experts=True, recipe=recipe)

    def run(fused):
        monkeypatch.setattr(operands, "one_launch", lambda t, op: fused and op[1])
        leaves = [t.to(DEV, copy=True).requires_grad_() for t in (x, *ws)]  # (GPU: compiled)
        y = fp8_expert_mlp(leaves[0], offsets.to(DEV), *leaves[1:], activation="swiglu",
                           rows=ExpertRows(gather_ids_R=ids.to(DEV)), config=cfg)  # fmt: skip
        y.square().sum().backward()
        return [y.detach().cpu()] + [t.grad.cpu() for t in leaves]

    for got, want in zip(run(True), run(False)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max()), (
            (got - want).abs().max()
        )


def test_fp8_grouped_mm_weight_gradient_on_the_device():
    """moe::fp8_grouped_mm's own backward on DEV (the FP8 GEMM on a GPU, the eager chain on
    CPU) against the eager chain on CPU: the weight gradient, both recipes."""
    from moe.fp8 import fp8_grouped_mm

    x, dy = _input(200, 128, seed=9, specials=False), _input(200, 256, seed=10, specials=False)
    w = torch.randn(5, 128, 256, generator=torch.Generator().manual_seed(11)) * 0.1
    for recipe in RECIPES:
        grads = []
        for dev in (DEV, "cpu"):
            leaf = w.to(dev).requires_grad_()
            y = fp8_grouped_mm(x.to(dev), leaf, OFFSETS.to(dev), recipe=recipe)
            y.backward(dy.to(dev))
            grads.append(leaf.grad.cpu())
        assert torch.allclose(*grads, rtol=1e-5, atol=1e-5 * grads[1].abs().max())


def test_codes_not_in_the_padded_layout_refused():
    """Codes whose width is not the padded layout's for M rows of E experts: one ValueError
    before any launch."""
    offsets = torch.tensor([5, 9], dtype=torch.int32)
    codes = torch.zeros(8, 16, dtype=torch.float8_e4m3fn)  # 9 rows of 2 experts need 48
    scales = torch.ones(2, 8)
    with pytest.raises(ValueError, match="column_codes"):
        fp8_wgrad_gemm((codes, scales), (codes, scales), offsets, 9, "rowwise", torch.float32)


def test_op_passes_opcheck():
    """moe::fp8_wgrad_gemm's schema and fake (meta) registration agree with the op (what
    torch.compile sees), both recipes' groupings."""
    offsets = torch.tensor([0, 20, 150], dtype=torch.int32)
    x, dy = _input(150, 16, seed=12, specials=False), _input(150, 24, seed=13, specials=False)
    utils = ("test_schema", "test_faketensor")
    for recipe, rows in (("rowwise", 0), ("blockwise", 128)):
        groups = scaling_groups(offsets, 150, recipe).to(DEV)
        a = column_codes(x.to(DEV), groups, offsets.to(DEV), True, FLOOR)
        b = column_codes(dy.to(DEV), groups, offsets.to(DEV), True, FLOOR)
        codes = lambda t: t.view(torch.uint8)  # (schema checks compare float8 args: no kernel)
        args = (codes(a[0]), a[1], codes(b[0]), b[1], offsets.to(DEV), 150, rows, torch.bfloat16)
        torch.library.opcheck(torch.ops.moe.fp8_wgrad_gemm, args, test_utils=utils)
