"""Per-step budgets of every layer variant, counted on the CUDA code path on CPU (bench.budget,
issue 61): each variant at the tiny shape stays within tests/data/budget_tiny.json (launches
per op, bytes outside the GEMMs, e4m3 writes per operand, host syncs; the GEMM FLOPs exactly).
A change that adds a pass or a launch fails here naming the op. When a change removes work,
lower the budget with

    python -m bench.budget --shapes tiny --micro-batches 2 --json tests/data/budget_tiny.json
"""

import json
import pathlib

import pytest
import torch

from bench import budget
from bench.budget_count import Counter
from bench.budget_device import cuda_stand_in

BUDGETS = pathlib.Path(__file__).parent / "data" / "budget_tiny.json"
MICRO_BATCHES = 2
CAPPED = ("launches", "triton", "gemms", "bytes_outside", "syncs", "collectives",
          "weight_casts", "opt_launches", "opt_bytes")  # fmt: skip


@pytest.fixture(scope="module")
def measured():
    return {v: budget.measure(v, budget.TINY, MICRO_BATCHES) for v in budget.VARIANTS}


def over_budget(got: dict, cap: dict) -> list[str]:
    """What exceeds the budget, one line per figure or op."""
    bad = [f"{k}: {got[k]} > budget {cap[k]}" for k in CAPPED if got[k] > cap[k]]
    if got["gemm_flops"] != cap["gemm_flops"]:
        bad.append(f"gemm_flops: {got['gemm_flops']} != {cap['gemm_flops']}")
    for table in ("ops", "e4m3"):
        for name, n in got[table].items():
            if n > cap[table].get(name, 0):
                bad.append(f"{table} {name!r}: {n} > budget {cap[table].get(name, 0)}")
    return bad


@pytest.mark.parametrize("variant", list(budget.VARIANTS))
def test_variant_within_budget(measured, variant):
    data = json.loads(BUDGETS.read_text())
    assert data["micro_batches"] == MICRO_BATCHES
    cap = data["budgets"]["tiny"][variant]
    bad = over_budget(budget.record(measured[variant]), cap)
    assert not bad, f"{variant} over its budget (tests/data/budget_tiny.json):\n" + "\n".join(bad)


def test_over_budget_names_the_op():
    cap = {k: 10 for k in CAPPED} | {"gemm_flops": 5, "ops": {"mul": 2}, "e4m3": {}}
    got = dict(cap) | {"launches": 11, "ops": {"mul": 3, "abs": 1}, "e4m3": {"weights": 1}}
    assert over_budget(got, cap) == [
        "launches: 11 > budget 10",
        "ops 'mul': 3 > budget 2",
        "ops 'abs': 1 > budget 0",
        "e4m3 'weights': 1 > budget 0",
    ]


def test_cuda_branches_taken(measured):
    """The stand-in reaches the GPU-only code: CUTLASS grouped GEMMs and the Triton combine on
    the torch kernel, Triton GEMMs on the Triton kernel, torch._scaled_grouped_mm for FP8."""
    torch_ops = measured["bf16 torch"].first.ops
    assert torch_ops["_grouped_mm"] > 0 and torch_ops["triton _gather_sum_kernel"] > 0
    assert measured["bf16 triton"].first.ops["triton _ragged_rows_kernel"] > 0
    assert measured["fp8 rowwise"].first.ops["_scaled_grouped_mm"] == 6  # fwd 3, dgrad 3
    for v in ("bf16 torch", "bf16 triton", "bf16 cutlass", "fp8 rowwise"):
        assert measured[v].first.syncs == 0, v


def test_gemm_flops_of_the_layer(measured):
    """9 expert GEMMs of 2 R d F FLOPs (up, gate, down; each with dgrad and wgrad; R = T k
    rows), and the router's 3 of 2 T d E."""
    s = budget.TINY
    gemm = 2 * s.T * s.k * s.d * s.F
    for v in ("bf16 torch", "bf16 triton", "bf16 cutlass"):
        assert measured[v].first.gemm_flops == 9 * gemm + 3 * 2 * s.T * s.d * s.E, v
    assert measured["fp8 rowwise"].first.fp8_flops == 9 * gemm  # weight gradients too, in e4m3


def test_counting_rules():
    """Views and allocations launch nothing; an overwrite reads nothing; GEMM bytes are apart;
    host reads are syncs; a Triton launch moves its tensor arguments."""
    c = Counter()
    with cuda_stand_in(c.on_op, c.on_custom, c.on_triton):
        a = torch.empty(8, 16, device="cuda", dtype=torch.bfloat16)  # allocation
        b = a.t().view(16, 8).transpose(0, 1)  # views
        a.zero_()  # writes 256 B
        y = a @ b.t().contiguous()  # a copy: 256 + 256 B; mm: 2*8*16*8 FLOPs
        a.sum().item()  # 256 B + 2 B, then one sync
        w = torch.empty(4, 16, 8, device="cuda", dtype=torch.bfloat16)
        offs = torch.empty(4, device="cuda", dtype=torch.int32)
        torch._grouped_mm(a, w, offs=offs)
    p = c.phases["first"]
    assert y.is_cuda and p.ops == {"zero_": 1, "clone": 1, "mm": 1, "sum": 1, "_grouped_mm": 1}
    assert p.launches == 5 and p.gemms == 2 and p.syncs == 1
    assert p.bytes_outside == 256 + 512 + 258
    assert p.gemm_flops == 2 * 8 * 16 * 8 + 2 * 8 * 16 * 8


def test_fp8_verdicts_name_the_targets(measured):
    lines = budget.fp8_vs_bf16(list(measured.values()))
    assert len(lines) == 6 and all("tiny, fp8" in line for line in lines)
    assert "= bf16 torch ep2 +" in lines[-1]


def test_expert_parallel_exchange_counted(measured):
    """EP = 2 (a fake process group): the count exchange (one all_to_all and its one host
    read), the rows there and back (2), and their backward (2); the same expert GEMM FLOPs as
    one process (balanced routing: this rank's experts receive R rows), the weighted combine
    as a bmm after the exchange."""
    for v in ("bf16 torch ep2", "fp8 rowwise +dispatch ep2"):
        p = measured[v].first
        assert (p.collectives, p.syncs) == (5, 1), v
        assert p.ops["c10d.alltoall_base_"] == 5, v
    ep, one = measured["bf16 torch ep2"].first, measured["bf16 torch"].first
    s = budget.TINY
    assert ep.gemm_flops == one.gemm_flops + 2 * s.T * s.k * s.d  # + the combine's bmm
    rows_bytes = s.T * s.k * s.d * 2  # R bf16 rows
    assert ep.collective_bytes >= 4 * rows_bytes  # out and back, forward and backward
    fp8 = measured["fp8 rowwise +dispatch ep2"].first.collective_bytes
    assert fp8 <= ep.collective_bytes - rows_bytes // 4  # the dispatch's rows in e4m3 + scales
