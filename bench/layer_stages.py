"""Where our MoE layer's time goes, for bench/moe_layer.py's report:

- stage_table: one profiled fwd+bwd, every aten op charged to its stage (route, plan,
  experts, the rest) and, inside the experts, to GEMMs / activation / gather+add / other.
- padded_vs_ragged: the rule for the expert compute layout, measured: the same fused expert
  op on the plan's ragged groups against groups padded to the busiest expert (one bmm).
- page_fault_table: what a fresh buffer over glibc's mmap threshold costs on this machine.
"""

import statistics
import time

import torch

import moe
from moe.kernels.expert_rows import ExpertRows
from moe.kernels.torch_expert_mlp import expert_mlp_torch

GEMM = {"aten::mm", "aten::bmm", "aten::_grouped_mm", "aten::addmm"}
ACTIVATION = {"aten::gelu", "aten::gelu_backward", "aten::silu", "aten::silu_backward"}
MOVES = {"aten::index_select", "aten::index_add_", "aten::index_copy", "aten::index_copy_"}


def _stage_of(event) -> str:
    """The stage an op belongs to: the nearest enclosing stage label or autograd node."""
    e = event
    while e is not None:
        name = e.name
        if name.startswith("stage:"):
            return name[6:]
        if "moe_expert_mlp" in name or name.startswith("moe::expert_mlp_backward"):
            return "experts"
        if name.startswith("autograd::engine::evaluate_function"):
            return "route" if any(s in name for s in ("Mm", "Softmax", "Topk")) else "rest"
        e = e.cpu_parent
    return "rest"


def _category(name: str) -> str:
    if name in GEMM:
        return "GEMMs"
    if name in ACTIVATION:
        return "activation"
    if name in MOVES:
        return "gather / add into tokens"
    return "other"


def _fwd_bwd(layer: moe.MoELayer, x_TD: torch.Tensor, dy_TD: torch.Tensor) -> None:
    """MoELayer._forward_tokens with each stage labelled, then backward."""
    from torch.profiler import record_function

    with record_function("stage:route"):
        routing = layer._route(x_TD)
    with record_function("stage:plan"):
        plan = layer._row_map(routing, len(x_TD))
        x_RD, offsets_L, ctx = layer.dispatcher.dispatch(x_TD, plan)
    with record_function("stage:experts"):
        out = layer.experts(x_RD, offsets_L, rows=ctx.expert_rows())
    with record_function("stage:rest"):
        y_TD = layer.dispatcher.combine(out, ctx)
        layer._record(routing, plan)
        loss = (y_TD * dy_TD).sum() + layer.aux_loss
    loss.backward()


def stage_table(layer: moe.MoELayer, tokens: int) -> str:
    x = torch.randn(tokens, layer.config.d_model, requires_grad=True)
    dy = torch.randn(tokens, layer.config.d_model)
    _fwd_bwd(layer, x, dy)  # warm-up
    layer.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _fwd_bwd(layer, x, dy)
    ms: dict[tuple[str, str], float] = {}
    total = 0.0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue  # self times of aten ops add up without double counting
        key = (_stage_of(e), _category(e.name) if _stage_of(e) == "experts" else "")
        ms[key] = ms.get(key, 0.0) + e.self_cpu_time_total / 1e3
        total += e.self_cpu_time_total / 1e3
    lines = ["| stage | part | ms | share of op time |", "|---|---|---|---|"]
    for (stage, part), t in sorted(ms.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {stage} | {part} | {t:.1f} | {t / total:.0%} |")
    return "\n".join(lines) + f"\n\nOp time in all: {total:.0f} ms (aten ops, self time)."


def _median_ms(fn, iters: int = 5) -> float:
    fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _padded(plan):
    """The plan's rows padded to the busiest expert's count: pad slots read token 0 with
    weight 0. -> (token_ids_S, row_weights_S, offsets_E, padded slots per row)."""
    counts_E, offsets_E = plan.counts_E, plan.offsets_E
    E, C, M = counts_E.shape[0], int(counts_E.max()), plan.num_rows
    rows_M = torch.arange(M)
    expert_M = torch.searchsorted(offsets_E, rows_M.to(offsets_E.dtype), right=True)
    slot_M = expert_M * C + rows_M - (offsets_E.long() - counts_E)[expert_M]
    ids_S = torch.zeros(E * C, dtype=torch.long).index_copy_(0, slot_M, plan.token_ids_M)
    weights_S = torch.zeros(E * C).index_copy_(0, slot_M, plan.row_weights().detach())
    return ids_S, weights_S, torch.arange(1, E + 1, dtype=torch.int32) * C, E * C / M


def padded_vs_ragged(d: int, F: int, E: int, k: int, tokens: int) -> tuple[float, float, float]:
    """(ragged ms, padded ms, padded slots per row): the experts' fwd+bwd on the router's
    real plan at init, both through the same fused op (padded groups run as one bmm)."""
    torch.manual_seed(0)
    layer = moe.MoELayer(d, F, E, top_k=k, capacity_factor=None)
    x = torch.randn(tokens, d, requires_grad=True)
    with torch.no_grad():
        plan = layer._row_map(layer._route(x), tokens)
    ragged = (plan.token_ids_M, plan.row_weights().detach(), plan.offsets_E)
    ids_S, weights_S, offsets_S, pad = _padded(plan)
    w = layer.experts

    def run(ids, weights, offsets):
        def step():
            rows = ExpertRows(gather_ids_R=ids, row_weights_R=weights, sum_to_tokens=True)
            y = expert_mlp_torch(x, offsets, w.w1, w.w2, activation="gelu", rows=rows)
            y.sum().backward()

        return step

    return (
        _median_ms(run(*ragged)),
        _median_ms(run(ids_S, weights_S, offsets_S)),
        pad,
    )


def page_fault_table(mib: int = 64) -> str:
    """A fresh tensor over glibc's mmap threshold (32 MiB at most) is fresh pages from the
    kernel, each faulted in on first write; a reused one is not."""
    n = mib * 2**20 // 4
    src = torch.randn(n)
    buf = torch.empty(n)
    fresh = _median_ms(lambda: src.clone(), 9)
    reused = _median_ms(lambda: buf.copy_(src), 9)
    small = _median_ms(lambda: src[: n // 16].clone(), 9) * 16
    return (
        f"| copy of {mib} MiB | ms |\n|---|---|\n| into a fresh tensor | {fresh:.1f} |\n"
        f"| into a reused tensor | {reused:.1f} |\n| as 16 fresh {mib // 16} MiB chunks | "
        f"{small:.1f} |"
    )
