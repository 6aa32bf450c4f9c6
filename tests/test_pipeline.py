"""Pipeline stages (moe.pipeline): PP x DP x EP on gloo equals one process on the same global
batch, float64, GPipe and 1F1B, ddp and fsdp; bad settings and inputs are one ValueError on
every rank, before any work."""

import functools
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe
from moe.parallel import ParallelConfig
from moe.pipeline import Pipeline, PipelineConfig, features, init_pipeline_mesh, plan_stages
from moe.pipeline.stage_parallel import stage_config
from tests.distributed import run_ranks

V, D, FF, E, S = 11, 8, 12, 4, 3  # vocabulary, width, FFN width, experts, tokens per sequence
ROWS, M, STEPS, LR = 4, 2, 3, 0.1  # sequences per pipeline per step, micro-batches, SGD
MOE = dict(top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01)
SHARED = dict(num_shared_experts=1, shared_d_ff=6, shared_expert_gate=True)  # on b1 only


# model variants: the dtype, or float64 MoE layers recomputed in backward and dropping pairs
VARIANTS = {
    "float64": {},
    "float32": {},
    "recompute_drops": {"recompute": True, "capacity_factor": 1.0},
}


class Block(nn.Module):
    def __init__(self, moe_ffn: bool, shared: bool = False, **options):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        if moe_ffn:
            self.ffn = moe.MoELayer(D, FF, E, **MOE, **(SHARED if shared else {}), **options)
        else:
            self.ffn = nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D))

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, x):
        return self.out(self.norm(x))


def build_model(variant="float64", **options):
    """Embedding, 4 blocks (b1 and b3 MoE, b1 with shared experts), head; the same weights on
    every rank. `options`: more MoELayer settings for both MoE blocks (tests/test_pipeline_
    features.py)."""
    torch.manual_seed(0)
    options = {**VARIANTS[variant], **options}
    blocks = [(f"b{i}", Block(i % 2 == 1, i == 1, **options)) for i in range(4)]
    model = nn.Sequential(OrderedDict([("embed", nn.Embedding(V, D)), *blocks, ("head", Head())]))
    return model.to(torch.float32 if variant == "float32" else torch.float64)


def batches(world):
    """STEPS global batches of (tokens, targets): `world` pipelines x ROWS sequences."""
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(V, (world * ROWS, S), generator=g),
            torch.randint(V, (world * ROWS, S), generator=g),
        )
        for _ in range(STEPS)
    ]


def loss_fn(logits, target, scale):
    """Summed cross-entropy x scale (= pipelines / global tokens): the mean over the stage's
    ranks (FSDP2's gradient mean) of the micro-batches' sum is the global mean."""
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="sum") * scale


@functools.lru_cache
def reference(width, M=M, variant="float64"):
    """One process, the same micro-batches: loss = sum over the `width` pipelines' M micro-batches
    of (task + aux / M) / width, SGD; step 0's outputs, losses, aux and grads; final params."""
    model = build_model(variant)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scale = width / (width * ROWS * S)
    first = None
    for x, y in batches(width):
        opt.zero_grad()
        outs, losses, auxes = [], [], []
        for r in range(width):
            xs, ys = x[r * ROWS : (r + 1) * ROWS], y[r * ROWS : (r + 1) * ROWS]
            out_r, loss_r, aux_r = [], [], 0.0
            for xm, ym in zip(xs.tensor_split(M), ys.tensor_split(M)):
                out = model(xm)
                loss, aux = loss_fn(out, ym, scale), moe.aux_loss(model)
                ((loss + aux / M) / width).backward()
                out_r.append(out.detach())
                loss_r.append(loss.detach())
                aux_r = aux_r + aux.detach() / M
            outs.append(torch.cat(out_r))
            losses.append(loss_r)
            auxes.append(aux_r)
        if first is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            first = (outs, losses, auxes, grads)
        opt.step()
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


class Case(NamedTuple):
    pp: int
    dp: int
    ep: int
    data_parallel: str
    schedule: str
    stages: list | None = None
    scale_grads: bool = False
    v: int = 1  # stages per rank
    M: int = M  # micro-batches
    variant: str = "float64"


@functools.lru_cache
def _mesh(pp, dp, ep):
    """One mesh per shape in a rank (each new mesh creates its process groups)."""
    return init_pipeline_mesh(pp, dp, ep)


def _run_case(rank, case):
    pp, dp, ep, data_parallel, schedule, stages, scale_grads, v, M, variant = case
    mesh = _mesh(pp, dp, ep)
    width = dp * ep
    config = PipelineConfig(
        schedule, microbatches=M, stages_per_rank=v, stages=stages, scale_grads=scale_grads
    )
    # scale_grads: PyTorch divides the gradients by M, and the aux losses enter with weight 1
    scale = width / (width * ROWS * S) * (M if scale_grads else 1)
    pipe = Pipeline(
        build_model(variant),
        mesh,
        config,
        functools.partial(loss_fn, scale=scale),
        parallel=ParallelConfig(data_parallel, "flat"),
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    r = rank % width
    first = None
    for x, y in batches(width):
        opt.zero_grad()
        rows = slice(r * ROWS, (r + 1) * ROWS)
        out, losses = pipe.step(x[rows], y[rows])
        aux = pipe.aux_loss()
        if first is None:
            grads = {n: p.grad.full_tensor() for n, p in pipe.named_parameters()}
            first = (None if out is None else out.detach(), losses, aux, grads)
        opt.step()
    params = {n: p.detach().full_tensor() for n, p in pipe.named_parameters()}
    return {"first": first, "params": params}


CASES = {
    "pp1_dp2_ep2_fsdp_gpipe": Case(1, 2, 2, "fsdp", "GPipe"),  # one stage: pp = 1 agrees
    "pp2_dp1_ep2_ddp_gpipe": Case(2, 1, 2, "ddp", "GPipe"),
    "pp2_dp1_ep2_ddp_1f1b": Case(2, 1, 2, "ddp", "1F1B"),
    "pp2_dp1_ep2_fsdp_gpipe": Case(2, 1, 2, "fsdp", "GPipe"),
    "pp2_dp1_ep2_fsdp_1f1b": Case(2, 1, 2, "fsdp", "1F1B"),
    "pp2_dp2_ep1_ddp_1f1b": Case(2, 2, 1, "ddp", "1F1B"),
    "pp2_dp2_ep1_fsdp_gpipe": Case(2, 2, 1, "fsdp", "GPipe"),
    "pp2_dp1_ep2_ddp_1f1b_scale_grads": Case(2, 1, 2, "ddp", "1F1B", None, True),
    # 2 stages per rank: embed b0 | b1 b2 | b3 | head (loop: rank 0 holds stages 0 and 2)
    "pp2_dp1_ep2_fsdp_interleaved1f1b": Case(2, 1, 2, "fsdp", "Interleaved1F1B", v=2),
    "pp2_dp1_ep2_ddp_interleavedzerobubble": Case(2, 1, 2, "ddp", "InterleavedZeroBubble", v=2),
    # V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    "pp2_dp1_ep2_ddp_zbv": Case(
        2, 1, 2, "ddp", "ZBVZeroBubble", [["embed", "b0", "b1"], ["b2"], ["b3"], ["head"]], v=2
    ),
    "pp2_dp1_ep2_fsdp_1f1b_float32": Case(2, 1, 2, "fsdp", "1F1B", variant="float32"),
    "pp2_dp1_ep2_ddp_1f1b_recompute_drops": Case(2, 1, 2, "ddp", "1F1B", variant="recompute_drops"),
    # stages without any MoE layer join no MoE collective: embed, b0 | b1, b2, b3, head
    "pp2_dp1_ep2_fsdp_1f1b_no_moe_stage": Case(
        2, 1, 2, "fsdp", "1F1B", [["embed", "b0"], ["b1", "b2", "b3", "head"]]
    ),
    "pp4_dp1_ep1_ddp_gpipe": Case(4, 1, 1, "ddp", "GPipe"),  # embed b0 | b1 b2 | b3 | head
    "pp2_dp1_ep2_ddp_dualpipev": Case(  # at least 2 pp micro-batches
        2, 1, 2, "ddp", "DualPipeV", [["embed", "b0", "b1"], ["b2"], ["b3"], ["head"]], v=2, M=4
    ),
}


class Picky(nn.Module):
    """Fails its forward on world rank 2 only."""

    def forward(self, x):
        import torch.distributed as dist

        if dist.get_rank() == 2:
            raise ValueError("picky on rank 2")
        return x


def _dense_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, D), nn.Linear(D, D)).double()


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _body(rank, world):
    import torch.distributed as dist

    out = {name: _run_case(rank, case) for name, case in CASES.items()}
    mesh = _mesh(2, 1, 2)
    loss = functools.partial(loss_fn, scale=1.0)
    odd = PipelineConfig(microbatches=3 if rank == 3 else 2)
    out["differs"] = _error(lambda: Pipeline(build_model(), mesh, odd, loss))
    bad = {"data_parallel": "zero"} if rank == 1 else {}
    out["bad_setting"] = _error(lambda: Pipeline(build_model(), mesh, PipelineConfig(), loss, bad))
    pipe = Pipeline(build_model(), mesh, PipelineConfig(), loss)
    x, y = batches(2)[0]
    rows = 3 if rank == 0 else ROWS  # stage 0, rank 0: 3 rows do not split into 2 micro-batches
    out["bad_input"] = _error(lambda: pipe.step(x[:rows], y[:ROWS]))
    # sync_params: each stage's ranks start from the stage's first rank's weights
    synced = Pipeline(_dense_model(seed=rank), mesh, PipelineConfig(), loss)
    out["synced"] = {n: p.detach().full_tensor() for n, p in synced.named_parameters()}
    # a stage failing in its first forward (finding the stage shapes): one error everywhere
    model = nn.Sequential(nn.Linear(D, D), Picky()).double()
    failing = Pipeline(model, mesh, PipelineConfig(), loss)
    xd = torch.randn(4, D, dtype=torch.float64)
    out["stage_fails"] = _error(lambda: failing.step(xd, xd))
    dist.barrier()  # still in step after every refusal
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 4, timeout=120)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _check_case(result, width, rank, loss_factor=1, M=M, variant="float64"):
    (outs, losses, auxes, grads), params = reference(width, M, variant)
    tol = 1e-5 if variant == "float32" else 1e-12
    r = rank % width
    out, got_losses, aux, got_grads = result["first"]
    if out is not None:  # the last stage: the schedule's merged output and losses
        assert _rel(out, outs[r]) <= tol
        for got, want in zip(got_losses, losses[r]):
            assert _rel(got / loss_factor, want) <= tol
    assert _rel(aux, torch.as_tensor(auxes[r], dtype=aux.dtype)) <= tol, (aux, auxes[r])
    assert got_grads, "no parameters on this stage"
    for name, g in got_grads.items():
        assert _rel(g, grads[name]) <= tol, (rank, name, _rel(g, grads[name]))
    for name, p in result["params"].items():
        assert _rel(p, params[name]) <= tol, (rank, name)


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_equals_one_process(results, name):
    case = CASES[name]
    factor = M if case.scale_grads else 1  # loss_fn returns M x the loss then
    for rank in range(4):
        _check_case(results[rank][name], case.dp * case.ep, rank, factor, case.M, case.variant)
    # one merged output per pipeline, on the rank holding the last stage
    assert (
        sum(results[rank][name]["first"][0] is not None for rank in range(4)) == case.dp * case.ep
    )
    # together the stages hold every parameter of the model
    names = set().union(*(results[rank][name]["params"] for rank in range(4)))
    assert names == {n for n, _ in build_model().named_parameters()}


def test_differences_and_bad_values_are_one_error_on_every_rank(results):
    for rank in range(4):
        out = results[rank]
        assert "pipeline.microbatches differs across ranks" in out["differs"], out["differs"]
        assert "rank 3 has 3" in out["differs"]
        bad = "rank 1: ParallelConfig.data_parallel must be 'ddp' or 'fsdp'"
        assert bad in out["bad_setting"], out["bad_setting"]
        assert "rank 0: x has 3 rows, not a multiple of microbatches=2" in out["bad_input"]
        assert "pipeline (stage shapes)" in out["stage_fails"], out["stage_fails"]
        assert "rank 2: picky on rank 2" in out["stage_fails"], out["stage_fails"]
    # stage s = ranks 2s, 2s + 1: both hold the weights of the stage's first rank's model
    for rank in range(4):
        first = 2 * (rank // 2)
        want = dict(_dense_model(seed=first).named_parameters())
        for name, p in results[rank]["synced"].items():
            assert torch.equal(p, want[name].detach()), (rank, name)


def test_config_and_stage_plan_are_checked_before_any_work():
    with pytest.raises(ValueError, match="schedule must be one of GPipe, 1F1B, Interleaved1F1B"):
        PipelineConfig(schedule="ZB")
    assert (
        PipelineConfig(schedule="interleaved1f1b", stages_per_rank=3).schedule == "Interleaved1F1B"
    )
    with pytest.raises(ValueError, match="ZBVZeroBubble runs two stages per rank"):
        PipelineConfig(schedule="ZBVZeroBubble")
    with pytest.raises(ValueError, match="1F1B runs one stage per rank"):
        PipelineConfig(stages_per_rank=2)
    with pytest.raises(ValueError, match="DualPipeV needs at least 4 micro-batches at pp=2"):
        PipelineConfig("DualPipeV", microbatches=2, stages_per_rank=2).check_stages(2)
    with pytest.raises(ValueError, match="needs a multiple of its 2 rounds"):
        PipelineConfig("Interleaved1F1B", microbatches=5, stages_per_rank=2).check_stages(2)
    with pytest.raises(ValueError, match="stages has 2 stages, but pp=2 x stages_per_rank=2 = 4"):
        PipelineConfig("Interleaved1F1B", stages_per_rank=2, stages=[["a"], ["b"]]).check_stages(2)
    with pytest.raises(ValueError, match="loses the last stage's weight gradients"):
        PipelineConfig("ZBVZeroBubble", stages_per_rank=2).check_data_parallel("fsdp")
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        PipelineConfig(microbatches=0)
    with pytest.raises(ValueError, match="1F1B needs at least 2 micro-batches at pp=2"):
        PipelineConfig(microbatches=1).check_stages(2)
    model = build_model()
    assert plan_stages(model, 2) == [["embed", "b0", "b1"], ["b2", "b3", "head"]]
    assert plan_stages(model, 4) == [["embed", "b0"], ["b1", "b2"], ["b3"], ["head"]]
    with pytest.raises(ValueError, match=r"not children of the model"):
        plan_stages(model, 2, [["embed", "b9"], ["b2", "b3", "head"]])
    with pytest.raises(ValueError, match="is out of order"):
        plan_stages(model, 2, [["embed", "b1", "b0"], ["b2", "b3", "head"]])
    with pytest.raises(ValueError, match=r"misses \['head'\]"):
        plan_stages(model, 2, [["embed", "b0", "b1"], ["b2", "b3"]])
    with pytest.raises(ValueError, match="splits an nn.Sequential"):
        plan_stages(Head(), 2)
    assert stage_config(None) == ParallelConfig()
    with pytest.warns(FutureWarning, match="pass moe.parallel.ParallelConfig"):
        assert stage_config({"data_parallel": "fsdp"}) == ParallelConfig("fsdp")
    with pytest.raises(ValueError, match="set that instead"):
        stage_config(ParallelConfig(sync_params=False))
    with pytest.raises(ValueError, match="must be a ParallelConfig"):
        stage_config(("fsdp",))
    no_stages = type("NoStages", (), {"modules": []})()  # the deprecated per-pipe aliases
    for name, core in (("update_router_biases", "moe"), ("reset_global_balance", "moe"),
                       ("sum_replica_grads", "moe.parallel")):  # fmt: skip
        with pytest.warns(FutureWarning, match=rf"call {core}.{name}\(pipe.local_model\(\)\)"):
            getattr(features, name)(no_stages)
