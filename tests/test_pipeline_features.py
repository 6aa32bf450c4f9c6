"""The MoE features per pipeline stage (issue 47; moe.pipeline.features) equal one process on
the same global batch, float64 to 1e-12: global balance statistics and aux-loss-free bias
updates (with the global balance loss, recompute), router record / replay (virtual stages,
recompute, 1F1B's micro-batch order) with routing traces per stage, rebalance_experts with
expert replicas and momentum, GroupedApply with CPU offload, FP8 dispatch. Outputs, losses,
gradients and the parameters after three steps; FSDP2 CPU offload per stage too; 4 gloo ranks,
one start."""

import contextlib
import functools
import json
from typing import NamedTuple

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

import moe
from moe.fp8 import FP8Config
from moe.parallel import ParallelConfig
from moe.pipeline import Pipeline, PipelineConfig, features
from moe.trace.replay import Routes
from tests.distributed import run_ranks
from tests.test_pipeline import LR, ROWS, M, S, _mesh, _rel, batches, build_model, loss_fn

TOL = 1e-12
BALANCE = (("balance_loss", "global"), ("score_func", "sigmoid"), ("bias_update_rate", 0.05))
FP8 = FP8Config(dispatch=True, grad_before_down_fp8=True, block_size=4)


class Case(NamedTuple):
    pp: int
    dp: int
    ep: int
    data_parallel: str
    schedule: str
    options: tuple = ()  # MoELayer settings of both MoE blocks
    v: int = 1
    opt: str = "sgd"  # "sgd", "momentum" (SGD, momentum 0.9), "grouped[_optimizer]" (AdamW)
    balance: bool = False  # update_router_biases + reset_global_balance after each step
    replicas: bool = False  # sum_replica_grads before, rebalance_experts after each step
    replay: bool = False  # record on the model, replay on a perturbed one
    trace: bool = False  # routing traces per stage
    accum: int = 1  # Pipeline.step calls per optimizer step (gradient accumulation)
    stages: tuple | None = None  # PipelineConfig.stages
    parallel: tuple = ()  # more parallelize() keywords


CASES = {
    "balance_1f1b_recompute_accum": Case(
        2, 1, 2, "ddp", "1F1B", (*BALANCE, ("recompute", True)), trace=True, balance=True, accum=2
    ),
    "balance_dp2_fsdp_gpipe": Case(2, 2, 1, "fsdp", "GPipe", BALANCE, balance=True),
    "replay_interleaved_recompute": Case(
        2, 1, 2, "fsdp", "Interleaved1F1B", (("recompute", True),), v=2, replay=True, trace=True
    ),
    "replay_1f1b_accum": Case(2, 1, 2, "ddp", "1F1B", replay=True, accum=2),
    # ranks 0 and 1 hold no MoE layer: they record nothing and join replay's agreement
    "replay_no_moe_stage": Case(
        2, 1, 2, "fsdp", "GPipe", replay=True, stages=(("embed", "b0"), ("b1", "b2", "b3", "head"))
    ),
    "replicas_rebalance_momentum_accum": Case(
        2, 1, 2, "ddp", "1F1B", (("spare_slots", 2),), opt="momentum", replicas=True, accum=2
    ),
    "grouped_offload_optimizer_dp2": Case(2, 2, 1, "fsdp", "1F1B", opt="grouped_optimizer"),
    "grouped_offload_ep2": Case(2, 1, 2, "fsdp", "GPipe", opt="grouped"),
    # FSDP2's CPU offload of every stage's parameters, gradients and optimizer step
    "fsdp_cpu_offload_policy": Case(
        2, 2, 1, "fsdp", "1F1B", parallel=(("offload_policy", CPUOffloadPolicy(pin_memory=False)),)
    ),
    "fp8_dispatch": Case(2, 1, 2, "ddp", "1F1B", (("fp8", FP8),)),
}


def _perturbed(model):
    """The routers' weights moved (the same on every rank): they would route otherwise."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, layer in moe.moe_layers(model):
            w = layer.router.weight
            w.add_(torch.randn(w.shape, generator=g, dtype=w.dtype))
    return model


def _optimizer(kind, named, grouped_ok=True):
    named = list(named)
    params = [p for _, p in named]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    if grouped_ok:  # "grouped": offload "all"; "grouped_optimizer": offload "optimizer"
        offload = kind.removeprefix("grouped_") if "_" in kind else "all"
        return moe.memory.GroupedApply(named, torch.optim.AdamW, groups=2, offload=offload, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01)


def _canonical(name, tensor, slots):
    """An expert tensor in canonical expert order (`slots`: slot_of_expert_E of its layer)."""
    layer = name.rsplit(".experts.", 1)[0]
    return tensor[slots[layer]] if ".experts." in name and layer in slots else tensor


def _train_reference(model, case, width, routes=None, replay=None, trace=None):
    """One process, the same micro-batches as `width` pipelines (with the global balance loss,
    each micro-batch the concatenation of the pipelines' as the stage's ranks compute it)."""
    opt = _optimizer(case.opt, model.named_parameters(), grouped_ok=False)
    scale = 1 / (ROWS * S)
    concat = dict(case.options).get("balance_loss") == "global"
    Mr = M * case.accum  # the micro-batches of all Pipeline.step calls of an optimizer step
    steps = []
    for x, y in batches(width):
        opt.zero_grad()
        outs = [[] for _ in range(width)]
        losses = [[] for _ in range(width)]
        xs = [x[r * ROWS : (r + 1) * ROWS].tensor_split(Mr) for r in range(width)]
        ys = [y[r * ROWS : (r + 1) * ROWS].tensor_split(Mr) for r in range(width)]
        groups = [[(r, m)] for r in range(width) for m in range(Mr)]
        if concat:
            groups = [[(r, m) for r in range(width)] for m in range(Mr)]
        for group in groups:
            xm = torch.cat([xs[r][m] for r, m in group])
            out = model(xm)
            total = moe.aux_loss(model) / M
            for (r, m), o in zip(group, out.tensor_split(len(group))):
                loss = loss_fn(o, ys[r][m], scale)
                total = total + loss / width if concat else (loss + total) / width
                outs[r].append(o.detach())
                losses[r].append(loss.detach())
            total.backward()
        if case.replicas:
            moe.parallel.sum_replica_grads(model)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        stats = {
            n: layer.stats["global_balance_loss"].clone()
            for n, layer in moe.moe_layers(model)
            if "global_balance_loss" in layer.stats
        }
        if case.balance:
            moe.update_router_biases(model)
            moe.reset_global_balance(model)
        if trace is not None:
            trace.step()
        steps.append(([torch.cat(o) for o in outs], losses, grads, stats))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    return steps, params, biases


def reference(name, width, trace_path=None):
    """(per step: outputs, losses, grads, global balance stats; params; biases; slot of each
    expert per layer; the recorded routes of a replay case)."""
    case = CASES[name]
    options = dict(case.options)
    routes = None
    if case.replay:
        recorder = build_model(**options)
        with moe.record_routing(recorder) as routes:
            _train_reference(recorder, case, width)
    model = build_model(**options)
    trace = None if trace_path is None else moe.RoutingTrace(model, trace_path)
    with moe.replay_routing(_perturbed(model), routes) if case.replay else contextlib.nullcontext():
        out = _train_reference(model, case, width, trace=trace)
    if trace is not None:
        trace.close()
    slots = {n: layer.slot_of_expert_E.clone() for n, layer in moe.moe_layers(model)}
    return (*out, slots, routes)


def _pipeline(case, model):
    config = PipelineConfig(
        case.schedule, microbatches=M, stages_per_rank=case.v, stages=case.stages
    )
    scale = 1 / (ROWS * S)
    mesh = _mesh(case.pp, case.dp, case.ep)
    parallel = ParallelConfig(case.data_parallel, "flat", **dict(case.parallel))
    return Pipeline(model, mesh, config, functools.partial(loss_fn, scale=scale), parallel)


def _train_pipeline(pipe, case, rank, trace_dir=None):
    width = case.dp * case.ep
    opt = _optimizer(case.opt, pipe.named_parameters())
    traces = {}
    if trace_dir is not None:
        traces = features.routing_traces(pipe, f"{trace_dir}/stage{{stage}}.jsonl")
    r, steps, moved = rank % width, [], 0
    for x, y in batches(width):
        opt.zero_grad()
        per_call = ROWS // case.accum
        outs, losses = [], []
        for a in range(case.accum):  # gradients accumulate over the calls
            rows = slice(r * ROWS + a * per_call, r * ROWS + (a + 1) * per_call)
            out, part = pipe.step(x[rows], y[rows])
            outs.append(out)
            losses += part or []
        out = None if outs[0] is None else torch.cat(outs)
        if case.replicas:
            moe.parallel.sum_replica_grads(pipe.local_model())
        grads = {n: p.grad.full_tensor() for n, p in pipe.named_parameters()}
        opt.step()
        stats = {
            n: layer.stats["global_balance_loss"].clone()
            for n, layer in moe.moe_layers(pipe.local_model())
            if "global_balance_loss" in layer.stats
        }
        if case.balance:
            moe.update_router_biases(pipe.local_model())
            moe.reset_global_balance(pipe.local_model())
        if case.replicas:
            reports = features.rebalance_experts(pipe, opt, min_gain=0.0)
            moved += sum(report.moved_experts for report in reports.values())
        for trace in traces.values():
            trace.step()
        steps.append((None if out is None else out.detach(), losses, grads, stats))
    for trace in traces.values():
        trace.close()
    local = pipe.local_model()
    params = {n: p.detach().full_tensor() for n, p in local.named_parameters()}
    biases = {n: b.clone() for n, b in local.named_buffers() if n.endswith("expert_bias")}
    slots = {n: layer.slot_of_expert_E.clone() for n, layer in moe.moe_layers(local)}
    return {"steps": steps, "params": params, "biases": biases, "slots": slots, "moved": moved}


def _run_case(rank, name, case, trace_dir):
    options = dict(case.options)
    if not case.replay:
        return _train_pipeline(_pipeline(case, build_model(**options)), case, rank, trace_dir)
    recorder = _pipeline(case, build_model(**options))
    with features.record_routing(recorder) as routes:
        _train_pipeline(recorder, case, rank)
    pipe = _pipeline(case, _perturbed(build_model(**options)))
    with features.replay_routing(pipe, routes), features.record_routing(pipe) as again:
        out = _train_pipeline(pipe, case, rank, trace_dir)
    out["routes"] = {n: [rec.expert_ids_TK for rec in recs] for n, recs in routes.layers.items()}
    # a problem on one rank (rank 2's routes miss its layers) is every rank's ValueError
    bad = Routes({}, rank=rank, world=4) if rank == 2 else routes
    try:
        with features.replay_routing(pipe, bad):
            out["bad_replay"] = "entered"
    except ValueError as e:
        out["bad_replay"] = str(e)
    out["again"] = {n: [rec.expert_ids_TK for rec in recs] for n, recs in again.layers.items()}
    return out


def _body(rank, world, tmp):
    out = {}
    for name, case in CASES.items():
        trace_dir = f"{tmp}/{name}" if case.trace else None
        out[name] = _run_case(rank, name, case, trace_dir)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline_features")
    return tmp, run_ranks(_body, 4, str(tmp), timeout=180)


def _check(name, got, rank, want):
    case = CASES[name]
    width = case.dp * case.ep
    steps, params, biases, want_slots, routes = want
    r, Mr = rank % width, M * case.accum
    slots = got["slots"]
    for t, (out, losses, grads, stats) in enumerate(got["steps"]):
        w_outs, w_losses, w_grads, w_stats = steps[t]
        if out is not None:
            assert _rel(out, w_outs[r]) <= TOL, (name, rank, t)
            for a, b in zip(losses, w_losses[r]):
                assert _rel(a, b) <= TOL, (name, rank, t)
        if t == 0 or not case.replicas:  # after a rebalance: in canonical order below
            for n, g in grads.items():
                assert _rel(g, w_grads[n]) <= TOL, (name, rank, n, t)
        for n, v in stats.items():
            assert _rel(v, w_stats[n]) <= TOL, (name, n, t, v, w_stats[n])
        assert set(stats) == {n for n in w_stats if n in slots}
    assert got["params"]
    for n, p in got["params"].items():
        want_p = _canonical(n, params[n], want_slots)
        assert _rel(_canonical(n, p, slots), want_p) <= TOL, (name, rank, n)
    for n, b in got["biases"].items():
        assert _rel(b, biases[n]) <= TOL, (name, rank, n)
    if case.balance:
        assert set(got["biases"]) == {n for n in biases if n.rsplit(".router", 1)[0] in slots}
        assert all(b.abs().sum() > 0 for b in got["biases"].values())  # the biases moved
    if routes is not None:  # rank r's records: its micro-batches, step by step, in order
        for n, recs in got["routes"].items():
            want_recs = routes[n]
            mine = [
                want_recs[(t * width + r) * Mr + m].expert_ids_TK
                for t in range(len(steps))
                for m in range(Mr)
            ]
            # ep ranks of one pipeline split nothing: each routes its own tokens
            assert len(recs) == len(mine), (name, n, len(recs), len(mine))
            for a, b in zip(recs, mine):
                assert torch.equal(a, b), (name, rank, n)
            assert all(torch.equal(a, b) for a, b in zip(got["again"][n], recs))


@pytest.mark.parametrize("name", list(CASES))
def test_feature_per_stage_equals_one_process(run, name, tmp_path):
    tmp, results = run
    case = CASES[name]
    width = case.dp * case.ep
    want = reference(name, width, tmp_path / "ref.jsonl" if case.trace else None)
    for rank in range(4):
        _check(name, results[rank][name], rank, want)
    names = set().union(*(results[rank][name]["params"] for rank in range(4)))
    assert names == {n for n, _ in build_model(**dict(case.options)).named_parameters()}
    if case.replicas:
        assert sum(results[rank][name]["moved"] for rank in range(4)) > 0  # something moved
    if case.trace:
        _check_traces(tmp / name, tmp_path / "ref.jsonl", case)
    if case.replay:
        for rank in range(4):
            error = results[rank][name]["bad_replay"]
            assert "the routes have no records for this MoE layer" in error, (rank, error)
            assert rank == 2 or error.startswith("rank 2: "), (rank, error)
    if case.stages is not None:  # the ranks of the stage without MoE layers recorded nothing
        assert not results[0][name]["routes"] and not results[1][name]["routes"]


def _check_traces(stage_dir, ref_path, case):
    """Each stage's file holds its MoE layers' counts over the stage's ranks: the one-process
    trace's lines of those layers (the load per EP rank aside)."""
    ref = [json.loads(line) for line in ref_path.read_text().splitlines()]
    files = sorted(stage_dir.glob("stage*.jsonl"))
    seen = set()
    for path in files:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        layers = {line["layer"] for line in lines}
        assert not layers & seen, layers  # a layer in one stage's file only
        seen |= layers
        want = [line for line in ref if line["layer"] in layers]
        assert len(lines) == len(want) == 3 * len(layers)
        for a, b in zip(lines, want):
            assert a["ep"] == case.ep and sum(a["rank_load"]) == sum(b["routed_per_expert"])
            for key in ("step", "layer", "tokens_per_expert", "routed_per_expert", "dropped"):
                assert a[key] == b[key], (path, key, a, b)
            assert abs(a["load_cv"] - b["load_cv"]) <= 1e-9
    assert seen == {line["layer"] for line in ref} == {"b1.ffn", "b3.ffn"}
    assert len(files) == 2  # b1 and b3 on different stages


def test_fp8_reference_quantizes():
    """The FP8 case compares a format, not a no-op: FP8 dispatch changes the outputs."""
    fp8 = reference("fp8_dispatch", 2)[0][0][0]
    plain = reference("replay_interleaved_recompute", 2)[0][0][
        0
    ]  # replay of its own routes: the plain model
    assert all(_rel(a, b) > 1e-6 for a, b in zip(fp8, plain))


@pytest.mark.parametrize("balance_loss", ["sequence", "global"])
def test_recompute_with_balance_loss_equals_no_recompute(balance_loss):
    """MoEConfig.recompute with the sequence / global balance loss (computed in the original
    forward only): no CheckpointError, and the gradients of two forwards equal no recompute."""
    grads = []
    for recompute in (True, False):
        torch.manual_seed(0)
        layer = moe.MoELayer(
            8, 12, 4, top_k=2, aux_loss_coef=0.1, recompute=recompute, balance_loss=balance_loss
        ).double()
        x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
        for _ in range(2):
            y = layer(x)
            (y.square().sum() + layer.aux_loss).backward()
        grads.append([x.grad, *(p.grad for p in layer.parameters())])
    for a, b in zip(*grads):
        assert _rel(a, b) <= TOL


def test_routing_traces_need_one_file_per_stage():
    with pytest.raises(ValueError, match="path must hold '{stage}'"):
        features.routing_traces(None, "trace.jsonl")
