"""The passes around the expert GEMMs that the bf16 path no longer makes (issue 61 item 4), each
checked for its numbers and, on the CUDA stand-in (bench/budget_device.py), for being gone:

- the router's float32 matmul in at most ROUTER_DEVICE_CHUNKS chunks off the CPU (was 4 MiB
  chunks: 32 at Mixtral, 6 launches each), against a float64 reference, outputs and gradients;
- s * act(pre), dW2's operand, written by the activation backward (the dact GEMM's epilogue on
  Triton, the activation-backward row pass on CUTLASS) instead of a recompute pass: bit for bit
  what the recompute pass wrote, under TRITON_INTERPRET=1;
- the combine weights' gradient partials allocated without a zero fill;
- the sum of expert rows into tokens (the fused combine, and dx of the gather) read through each
  token's rows from the row map instead of an inverse map rebuilt (sort + searchsorted) in the
  forward and again in the backward: bit for bit the sums of the sort-built map.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from bench import budget  # noqa: E402
from bench.budget_count import Counter  # noqa: E402
from bench.budget_device import cuda_stand_in  # noqa: E402
from bench.titan_style import parse_shapes  # noqa: E402
from moe.gating import base as router_base  # noqa: E402
from moe.kernels.triton.activations import ACT_CODES, act_rows  # noqa: E402
from moe.kernels.triton.gather_sum import rows_to_tokens, sorted_token_rows  # noqa: E402
from moe.kernels.triton.grouped_mm import EPI_ACT_BWD, ragged_mm  # noqa: E402
from moe.kernels.triton.row_passes import act_bwd_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- router
def test_router_chunks_bounded_off_the_cpu():
    """At most 4 chunks on a GPU, each upcasting at most about half x's 16-bit bytes (no
    float32 copy of the whole of x); the CPU keeps its 4 MiB chunks."""
    for T, D in ((8192, 4096), (16384, 2048), (8192, 7168), (5, 3), (1, 8)):
        x = torch.empty(T, D, dtype=torch.bfloat16, device="meta")
        chunks = router_base._row_chunks(x)
        assert chunks[0][0] == 0 and chunks[-1][1] == T
        assert all(a < b and b == c for (a, b), (c, _) in zip(chunks, chunks[1:] + [(T, 0)]))
        assert len(chunks) <= router_base.ROUTER_DEVICE_CHUNKS
        rows = max(b - a for a, b in chunks)
        assert rows * D * 4 <= max(T * D * 2 // 2 + 4 * D, router_base.ROUTER_CHUNK_BYTES)
        on_cpu = router_base._row_chunks(torch.empty(T, D, dtype=torch.bfloat16))
        assert max(b - a for a, b in on_cpu) == min(T, router_base.ROUTER_CHUNK_BYTES // (4 * D))


@pytest.mark.parametrize("T,D,E", [(37, 24, 6), (301, 40, 8), (1, 16, 3)])
def test_router_matmul_device_chunks_match_float64(monkeypatch, T, D, E):
    """The GPU's chunk plan (at most 4 chunks), run on the CPU: logits, dx and dw equal a float64 reference to
    float32 rounding (each product is exact; only the float32 sums round)."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(E, D, generator=g).to(torch.bfloat16).requires_grad_()
    dl = torch.randn(T, E, generator=g)
    monkeypatch.setattr(router_base, "ROUTER_CHUNK_BYTES", 4)  # the bound, not 4 MiB, decides
    plan = router_base._row_chunks(x.detach().to("meta"))
    assert len(plan) == min(T, router_base.ROUTER_DEVICE_CHUNKS)
    monkeypatch.setattr(router_base, "_row_chunks", lambda x_TD: plan)
    logits = router_base.router_matmul(x, w)
    logits.backward(dl)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = x64 @ w64.t()
    ref.backward(dl.double())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad.to(torch.bfloat16).double())
    torch.testing.assert_close(x.grad.double(), x64.grad.to(torch.bfloat16).double())


def count(fn) -> dict:
    """The launches `fn` issues on the CUDA stand-in, by op."""
    c = Counter()
    with cuda_stand_in(c.on_op, c.on_custom, c.on_triton):
        fn()
    return c.phases["first"].ops


def test_router_launches_at_mixtral():
    """Mixtral's router (T 8192, d 4096, E 8): 4 chunks x (upcast + mm) forward, 4 x (mm +
    downcast) for dx, 4 x (upcast + addmm) for dw; was 32 chunks (~190 launches)."""
    s = parse_shapes("mixtral")[0]

    def step():
        x = torch.empty(s.T, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(s.E, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        router_base.router_matmul(x, w).backward(torch.empty(s.T, s.E, device="cuda"))

    ops = count(step)
    assert ops["mm"] == 8 and ops["addmm_"] == 4, ops
    assert sum(ops.values()) <= 30, ops


# ----------------------------------------------------------------------------- s * act(pre)
def dact_case(counts, tail, F, activation, dtype, scaled, seed=0):
    g = torch.Generator().manual_seed(seed)
    R, E, D = sum(counts) + tail, len(counts), 24
    gated = activation == "swiglu"
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEVICE)
    return dict(
        d_out=rnd(R, D), w2=rnd(E, F, D), pre=rnd(R, 2 * F if gated else F),
        offsets=torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE),
        s=(torch.rand(R, generator=g) - 0.3).to(DEVICE) if scaled else None,
    )  # fmt: skip


CASES = [
    ([5, 0, 17, 2], 3, 40, "swiglu", torch.bfloat16, True),
    ([5, 0, 17, 2], 3, 40, "swiglu", torch.float32, False),
    ([9, 4], 0, 7, "gelu", torch.float32, True),
    ([0, 0, 1], 5, 16, "relu", torch.float16, True),
    ([33], 0, 24, "gelu_tanh", torch.bfloat16, False),
]


@pytest.mark.parametrize("counts,tail,F,activation,dtype,scaled", CASES)
def test_dact_epilogue_writes_the_recomputed_activation(counts, tail, F, activation, dtype, scaled):
    """The dact GEMM's second output equals what the removed act_rows pass wrote, bit for bit
    (tail rows zero), and its first output is unchanged by writing it."""
    c = dact_case(counts, tail, F, activation, dtype, scaled)
    R, gated = c["d_out"].shape[0], activation == "swiglu"
    want = act_rows(c["pre"], F, activation, c["s"], c["offsets"])
    outs = []
    for act_out in (None, c["pre"].new_empty(R, F)):
        dpre = c["pre"].new_empty(c["pre"].shape)
        rowdot = torch.empty((F + 15) // 16, R, device=DEVICE) if scaled else None
        ragged_mm(c["d_out"], c["w2"].transpose(1, 2), c["offsets"], dpre, epilogue=EPI_ACT_BWD,
                  act=ACT_CODES[activation], pre=c["pre"], gated=gated, row_scale_M=c["s"],
                  rowdot_NM=rowdot, act_out=act_out)  # fmt: skip
        outs.append((dpre, rowdot, act_out))
    (dpre0, rowdot0, _), (dpre1, rowdot1, a) = outs
    assert torch.equal(a, want)
    assert torch.equal(a[c["offsets"][-1] :], torch.zeros_like(a[c["offsets"][-1] :]))
    assert torch.equal(dpre0, dpre1)
    if scaled:
        assert torch.equal(rowdot0, rowdot1)


@pytest.mark.parametrize("counts,tail,F,activation,dtype,scaled", CASES[:4])
def test_act_bwd_rows_writes_the_recomputed_activation(counts, tail, F, activation, dtype, scaled):
    """The CUTLASS roles' activation-backward row pass: the same second output."""
    c = dact_case(counts, tail, F, activation, dtype, scaled, seed=1)
    R = c["d_out"].shape[0]
    da = torch.randn(R, F, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    want = act_rows(c["pre"], F, activation, c["s"], c["offsets"])
    dpre0, ds0 = act_bwd_rows(da, c["pre"], activation, c["s"], c["offsets"])
    a = c["pre"].new_empty(R, F)
    dpre1, ds1 = act_bwd_rows(da, c["pre"], activation, c["s"], c["offsets"], a)
    assert torch.equal(a, want) and torch.equal(dpre0, dpre1)
    assert (ds0 is None and ds1 is None) or torch.equal(ds0, ds1)


# ----------------------------------------------------------------------------- rows into tokens
@pytest.mark.parametrize("T,K,live_of,D", [(13, 3, 30, 20), (1, 1, 0, 8), (7, 2, 14, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_into_tokens_from_the_row_map(T, K, live_of, D, dtype):
    """A real row map (top-k with capacity drops: tail rows past the live count, contributing
    nothing): summing through each token's sorted rows equals the sort-built inverse map bit
    for bit, and a float64 per-token loop to rounding."""
    from moe.dispatch.permute import token_choice_rows

    g = torch.Generator().manual_seed(T * K + D)
    E = 4
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    plan = token_choice_rows(ids, torch.rand(T, K, generator=g), E, capacity=live_of // E or 1)
    rows = torch.randn(T * K, D, generator=g).to(dtype)
    live = plan.offsets_E[-1]
    want = rows_to_tokens(rows, plan.token_ids_M, live, T)
    got = rows_to_tokens(rows, plan.token_ids_M, live, T, sorted_token_rows(plan.pair_rows_TK))
    assert torch.equal(got, want)
    ref = torch.zeros(T, D, dtype=torch.float64)
    for m in range(int(live)):
        ref[plan.token_ids_M[m]] += rows[m].double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-2 if dtype != torch.float32 else 1e-6,
                               atol=1e-2 if dtype != torch.float32 else 1e-6)  # fmt: skip


# ----------------------------------------------------------------------------- the budget
@pytest.fixture(scope="module")
def tiny():
    return {v: budget.measure(v, budget.TINY, 1).first for v in ("bf16 triton", "bf16 cutlass")}


def test_no_activation_recompute_pass(tiny):
    """bf16 triton: no act_rows launch at all (the up GEMM's epilogue forward, the dact GEMM's
    backward); CUTLASS: one, the forward's (torch._grouped_mm has no epilogue)."""
    assert tiny["bf16 triton"].ops["triton _act_rows_kernel"] == 0
    assert tiny["bf16 cutlass"].ops["triton _act_rows_kernel"] == 1
    assert tiny["bf16 cutlass"].ops["triton _act_bwd_rows_kernel"] == 1


def test_no_inverse_map_rebuilt(tiny):
    """The sum into tokens (forward and dx) rebuilds no inverse map: no searchsorted, and one
    sort of the [T, k] map beside the row map's and the weight gradients' expert order."""
    for v in ("bf16 triton", "bf16 cutlass"):
        assert tiny[v].ops["searchsorted"] == 0, v
        assert tiny[v].ops["triton _gather_sum_kernel"] == 2, v


def test_no_zero_fill_in_the_triton_backward(tiny):
    """The combine weights' gradient partials: no zeros launch in the Triton expert backward
    (the layer's own zeros: the row counts and the balance statistics, 2)."""
    assert tiny["bf16 triton"].ops["zeros"] <= 2
