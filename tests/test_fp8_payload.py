"""FP8 dispatch payload (moe/fp8/payload.py): pack/unpack, the exchange on 2 gloo ranks equal
to a local quantize/dequantize of the same rows (both directions, every scale format), the
bytes the exchange hands to the collective counted by a spy, FP8Config agreement across ranks,
FP8 dispatch + FP8 experts on 2 ranks against one process, and the quality of FP8 dispatch alone on the layer-equivalent output."""

import pytest
import torch
import torch.distributed as dist

from moe.comm.expert_exchange import all_to_all_splits
from moe.fp8 import FP8Config, fp8_combine, fp8_dispatch, fp8_expert_mlp, pack_rows, unpack_rows
from moe.fp8.config import agree_across_ranks
from moe.fp8.payload import dequantize_payload, quantize_payload, scale_bytes
from moe.fp8.quant import fake_quant_blocks
from moe.kernels.expert_rows import ExpertRows
from moe.kernels.torch_expert_mlp import expert_mlp_torch
from tests.distributed import run_ranks
from tests.fp8_reference import ref_blocks, sqnr

FORMATS = ("fp32", "pow2", "ue8m0")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("D", [1, 130, 256])
def test_pack_unpack_round_trip(fmt, D):
    torch.manual_seed(D)
    x = torch.randn(5, D, dtype=torch.bfloat16) * 10
    q, s = quantize_payload(x, 128, fmt)
    packed = pack_rows(q, s, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (5, D + scale_bytes(D, 128, fmt))
    assert packed.is_contiguous()
    q2, s2 = unpack_rows(packed, D, fmt)
    assert torch.equal(q2, q) and torch.equal(s2, s)
    y = dequantize_payload(q2, s2, 128, torch.float32)
    assert torch.equal(y, ref_blocks(x, 128, fmt != "fp32").float())


class _ByteSpy:
    """Wraps dist.all_to_all_single: bytes each call hands over for other ranks."""

    def __init__(self, rank):
        self.rank, self.sent, self.inner = rank, 0, dist.all_to_all_single

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        rows = input_split_sizes or [input.shape[0] // dist.get_world_size()] * 2
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        self.sent += sum(n for i, n in enumerate(rows) if i != self.rank) * row_bytes
        return self.inner(output, input, output_split_sizes, input_split_sizes, *a, **k)


def _sent_bytes(rank, fn):
    spy = _ByteSpy(rank)
    dist.all_to_all_single = spy
    try:
        fn()
    finally:
        dist.all_to_all_single = spy.inner
    return spy.sent


def _exchange_body(rank, world_size):
    torch.manual_seed(rank)
    mine = FP8Config(dispatch=True, scale_format=["fp32", "ue8m0"][rank])
    try:
        agree_across_ranks(mine)
        disagreement = None
    except ValueError as e:
        disagreement = str(e)
    agree_across_ranks(FP8Config(dispatch=True))  # equal configs pass
    counts = [[2, 5], [0, 4]][rank]  # uneven, rank 1 sends nothing to rank 0
    x = torch.randn(sum(counts), 300) * 5
    plan = all_to_all_splits(x, counts)
    back = plan.reverse()
    ok = {}
    for fmt in FORMATS:
        cfg = FP8Config(dispatch=True, scale_format=fmt, grad_before_down_fp8=True)
        fq = lambda t, p=fmt != "fp32": fake_quant_blocks(t, 128, p)  # noqa: E731
        for grad_fp8 in (False, True):
            xl = x.clone().requires_grad_()
            y = fp8_dispatch(xl, plan, cfg, grad_fp8=grad_fp8)
            g = torch.randn_like(y)
            y.backward(g)
            ok[fmt, "fwd"] = torch.equal(y, plan.run(fq(x)))
            ok[fmt, "bwd", grad_fp8] = torch.equal(xl.grad, back.run(fq(g) if grad_fp8 else g))
        yl = y.detach().requires_grad_()
        z = fp8_combine(yl, back, cfg)  # combine: plain forward, FP8 gradient before down
        gz = torch.randn_like(z)
        z.backward(gz)
        ok[fmt, "combine"] = torch.equal(z, back.run(y.detach())) and torch.equal(
            yl.grad, plan.run(fq(gz))
        )
    plain = fp8_dispatch(x, plan, FP8Config(experts=True))  # dispatch off: the rows as they are
    ok["off"] = torch.equal(plain, plan.run(x)) and torch.equal(fp8_dispatch(x, plan, None), plain)
    # bytes at d = 7168, counted at the collective
    xb = torch.randn(4, 7168, dtype=torch.bfloat16)
    plan_b = all_to_all_splits(xb, [2, 2])
    sent = {"bf16": _sent_bytes(rank, lambda: plan_b.run(xb))}
    xl = xb.clone().requires_grad_()  # bf16 in, bf16 out, bf16 gradient home
    y = fp8_dispatch(xl, plan_b, FP8Config(dispatch=True))
    y.backward(torch.ones_like(y))
    ok["bf16"] = y.dtype == xl.grad.dtype == torch.bfloat16 and bool((xl.grad == 1).all())
    for fmt in FORMATS:
        cfg = FP8Config(dispatch=True, scale_format=fmt)
        sent[fmt] = _sent_bytes(rank, lambda c=cfg: fp8_dispatch(xb, plan_b, c))
    return ok, sent, disagreement, _ep_body(rank, world_size)


class _Local:
    """The one-process exchange: rows stay where they are."""

    def run(self, x):
        return x.clone()

    def reverse(self):
        return self


def _ep_step(x_TD, expert_T, weights, plan, cfg):
    """Top-1 MoE step with one expert per rank: FP8 dispatch -> FP8 experts -> combine (FP8
    gradient before the down-projection) -> token rows in their original order."""
    order = torch.argsort(expert_T, stable=True)
    rows = fp8_dispatch(x_TD[order], plan, cfg)
    offsets = torch.tensor([rows.shape[0]], dtype=torch.int32)
    if plan.__class__ is _Local:  # one process: every expert, its rows in source order
        offsets = torch.cumsum(torch.bincount(expert_T, minlength=2), 0).to(torch.int32)
    out = fp8_expert_mlp(rows, offsets, *weights, activation="swiglu", config=cfg)
    back = fp8_combine(out, plan.reverse(), cfg)
    return torch.empty_like(back).index_copy(0, order, back)


def _ep_body(rank, world_size):
    """FP8 dispatch + FP8 experts on 2 ranks (expert r on rank r) equal one process applying
    the same quantization to the global batch: outputs, input and weight gradients."""
    g = torch.Generator().manual_seed(0)  # the same global batch and experts on every rank
    T, D, F = 6, 200, 48
    x_WTD = torch.randn(2, T, D, generator=g)
    expert_WT = torch.randint(0, 2, (2, T), generator=g)
    w = [torch.randn(2, D, F, generator=g), torch.randn(2, F, D, generator=g) / 7]
    w.insert(2, torch.randn(2, D, F, generator=g))
    dy_WTD = torch.randn(2, T, D, generator=g)
    cfg = FP8Config(dispatch=True, experts=True, grad_before_down_fp8=True)

    def step(x_TD, expert_T, weights, plan, dy):
        leaves = [t.clone().requires_grad_() for t in (x_TD, *weights)]
        y = _ep_step(leaves[0], expert_T, leaves[1:], plan, cfg)
        y.backward(dy)
        return [y] + [t.grad for t in leaves]

    # global order of the one-process rows: by expert, then source rank, like the exchange
    x_all, e_all, dy_all = x_WTD.flatten(0, 1), expert_WT.flatten(), dy_WTD.flatten(0, 1)
    ref = step(x_all, e_all, w, _Local(), dy_all)
    counts = torch.bincount(expert_WT[rank], minlength=2)
    plan = all_to_all_splits(x_WTD[rank], counts)
    got = step(x_WTD[rank], expert_WT[rank], [t[rank : rank + 1] for t in w], plan, dy_WTD[rank])
    mine = slice(rank * T, (rank + 1) * T)
    pairs = [(got[0], ref[0][mine]), (got[1], ref[1][mine])]
    pairs += [(gw[0], rw[rank]) for gw, rw in zip(got[2:], ref[2:])]
    return [
        float((a - b).abs().max() / b.abs().max())
        for a, b in ((a.detach(), b.detach()) for a, b in pairs)
    ]


def test_fp8_exchange_on_two_ranks_equals_local_quantization_and_counts_bytes():
    for ok, sent, disagreement, ep_errors in run_ranks(_exchange_body, 2, timeout=60):
        assert max(ep_errors) <= 1e-6, ep_errors  # y, dx, dw1, dw2, dw3 against one process
        assert disagreement == (
            "FP8Config.scale_format differs across ranks: rank 0 has fp32, rank 1 has ue8m0"
        )
        assert all(ok.values()), [k for k, v in ok.items() if not v]
        assert sent["bf16"] == 2 * 7168 * 2
        assert sent["fp32"] == sent["pow2"] == 2 * (7168 + 4 * 56)
        assert sent["fp32"] <= 0.52 * sent["bf16"] and sent["ue8m0"] == 2 * (7168 + 56)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quality_fp8_dispatch_alone(seed):
    """Tokens quantized 1 x 128 before the experts, everything else float32: >= 27 dB on the
    layer-equivalent output (expert MLPs, combine weights, sum into tokens; d = 512)."""
    g = torch.Generator().manual_seed(seed)
    T, D, F, L, K = 64, 512, 128, 4, 2
    x = torch.randn(T, D, generator=g)
    w1, w2 = torch.randn(L, D, F, generator=g) / D**0.5, torch.randn(L, F, D, generator=g) / F**0.5
    w3 = torch.randn(L, D, F, generator=g) / D**0.5
    rows = ExpertRows(
        gather_ids_R=torch.randint(0, T, (T * K,), generator=g),
        row_weights_R=torch.rand(T * K, generator=g),
        sum_to_tokens=True,
    )
    offsets = torch.tensor([30, 70, 70, 128], dtype=torch.int32)
    run = lambda t: expert_mlp_torch(t, offsets, w1, w2, w3, activation="swiglu", rows=rows)  # noqa: E731
    db = sqnr(run(x), run(fake_quant_blocks(x)))
    print(f"FP8 dispatch alone, seed {seed}: SQNR {db:.2f} dB")
    assert db >= 27
