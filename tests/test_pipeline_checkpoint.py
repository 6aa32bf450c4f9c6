"""Pipeline checkpoints (issue 47): a DCP checkpoint saved by a Pipeline at (pp, dp, ep) =
(2, 1, 2) loads at (1, 2, 2), in one process (1, 1, 1) and back at (2, 1, 2), and at
(2, 2, 1): weights and Adam state (moments, step) bit for bit after every hop. A resumed
pipelined run equals the uninterrupted one bit for bit at the same layout, and within 1e-12
(float64) at another (other reduction orders: FSDP sums over other ranks, the stages' matmuls
see other row counts). Another model or expert count is refused before any tensor is read."""

import functools
import json
import os
import shutil
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import moe
from moe.checkpoint import CheckpointError, checkpoint_dir, load_checkpoint, save_checkpoint
from moe.checkpoint.parts import ModelParts
from moe.checkpoint.storage import read_metadata_json
from moe.memory import GroupedApply
from moe.parallel import ParallelConfig, init_mesh, parallelize
from moe.pipeline import Pipeline, PipelineConfig, init_pipeline_mesh
from tests.distributed import run_ranks
from tests.test_pipeline import FF, MOE, D, S, V, build_model, loss_fn

G, ROWS_PER_MICROBATCH, LR = 8, 2, 0.01  # global batch (sequences), micro-batch rows, Adam
MICROBATCHES = G // ROWS_PER_MICROBATCH  # in every layout: M x dp x ep
SAVED_AT, RESUMED_AT = 2, 4  # steps


def _batches():
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(V, (G, S), generator=g), torch.randint(V, (G, S), generator=g))
        for _ in range(RESUMED_AT)
    ]


def _fresh(model: nn.Module) -> nn.Module:
    """Other weights than the checkpoint's (a load must replace every one)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@functools.lru_cache
def _mesh(pp, dp, ep):
    return init_pipeline_mesh(pp, dp, ep)


def _pipeline(layout, model=None, data_parallel="fsdp", schedule=None):
    pp, dp, ep = layout
    width = dp * ep
    m = MICROBATCHES // width
    schedule = schedule or ("1F1B" if pp > 1 and m >= pp else "GPipe")
    v = 2 if schedule == "Interleaved1F1B" else 1  # two stages on each rank
    config = PipelineConfig(schedule, microbatches=m, stages_per_rank=v)
    scale = width / (G * S)  # summed cross-entropy; the mean over the stage's ranks
    pipe = Pipeline(
        _fresh(build_model()) if model is None else model,
        _mesh(*layout),
        config,
        functools.partial(loss_fn, scale=scale),
        ParallelConfig(data_parallel, "flat"),
    )
    return pipe, torch.optim.Adam(pipe.parameters(), lr=LR)


def _train_pipeline(pipe, opt, steps, rank):
    width = pipe.mesh.size(1) * pipe.mesh.size(2)
    r, rows = rank % width, G // width
    for x, y in steps:
        opt.zero_grad()
        pipe.step(x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows])
        opt.step()


def _train_one_process(model, opt, steps):
    """The same micro-batches and objective: the task loss's global mean plus each
    micro-batch's aux loss / MICROBATCHES (what every pipeline layout differentiates)."""
    for x, y in steps:
        opt.zero_grad()
        for xm, ym in zip(x.split(ROWS_PER_MICROBATCH), y.split(ROWS_PER_MICROBATCH)):
            out = model(xm)
            (loss_fn(out, ym, 1 / (G * S)) + moe.aux_loss(model) / MICROBATCHES).backward()
        opt.step()


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(named, opt) -> dict:
    """Every parameter and its optimizer state, whole (a stage's ranks gather together)."""
    out = {}
    for n, p in named:
        out[f"param {n}"] = _full(p)
        # .get: indexing a torch optimizer's state adds an empty entry, which torch's
        # get_optimizer_state_dict then takes for an initialised state
        state = opt.state_of(p) if isinstance(opt, GroupedApply) else opt.state.get(p, {})
        for key, value in sorted(state.items()):
            out[f"state {n} {key}"] = _full(value)
    return out


def _refused(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "not refused"


def _first_body(rank, world, path):
    """(2, 1, 2): train, save A, train on (uninterrupted); resume from A at (2, 1, 2) and at
    (1, 2, 2) (which saves B), load A at (2, 2, 1), at (2, 1, 2) with two stages per rank and
    into a plain (dp, ep) = (2, 2) model (which saves E); a GroupedApply pipeline saves D;
    refusals."""
    steps, out = _batches(), {}
    a, b, d = (os.path.join(path, n) for n in "abd")
    pipe, opt = _pipeline((2, 1, 2))
    _train_pipeline(pipe, opt, steps[:SAVED_AT], rank)
    save_checkpoint(a, pipe, opt, extra={"step": SAVED_AT})
    out["saved"] = _snapshot(pipe.named_parameters(), opt)
    _train_pipeline(pipe, opt, steps[SAVED_AT:], rank)
    out["uninterrupted"] = _snapshot(pipe.named_parameters(), opt)
    for name, layout, dp_mode in (("212", (2, 1, 2), "fsdp"), ("122", (1, 2, 2), "ddp")):
        pipe, opt = _pipeline(layout, data_parallel=dp_mode)
        out[f"extra {name}"] = load_checkpoint(a, pipe, opt)
        out[f"loaded {name}"] = _snapshot(pipe.named_parameters(), opt)
        if name == "122":
            save_checkpoint(b, pipe, opt, extra={"step": SAVED_AT})
        _train_pipeline(pipe, opt, steps[SAVED_AT:], rank)
        out[f"resumed {name}"] = _snapshot(pipe.named_parameters(), opt)
    pipe, opt = _pipeline((2, 2, 1))
    load_checkpoint(a, pipe, opt)
    out["loaded 221"] = _snapshot(pipe.named_parameters(), opt)
    # 4 stages, two on each rank: embed b0 | b1 b2 | b3 | head (rank 0: stages 0 and 2)
    pipe, opt = _pipeline((2, 1, 2), schedule="Interleaved1F1B")
    load_checkpoint(a, pipe, opt)
    out["loaded 212 v2"] = _snapshot(pipe.named_parameters(), opt)
    # a plain (dp, ep)-parallelized model (no pipeline) reads and writes the same format: E
    plain = parallelize(_fresh(build_model()), init_mesh(dp=2, ep=2), "fsdp", algorithm="flat")
    opt = torch.optim.Adam(plain.parameters(), lr=LR)
    load_checkpoint(a, plain, opt)
    out["loaded plain 122"] = _snapshot(plain.named_parameters(), opt)
    save_checkpoint(os.path.join(path, "e"), plain, opt)
    # GroupedApply (2 apply groups per stage) over the pipeline's parameters; D loads into a
    # one-process GroupedApply with 3
    pipe, _ = _pipeline((2, 1, 2))
    grouped = GroupedApply(pipe.named_parameters(), torch.optim.Adam, 2, lr=LR)
    _train_pipeline(pipe, grouped, steps[:1], rank)
    save_checkpoint(d, pipe, grouped)
    out["grouped"] = _snapshot(pipe.named_parameters(), grouped)
    # refusals, each before any tensor is read: the pipeline's weights stay as they were
    eight = build_model()  # b1 with 8 experts (stage 0 only)
    eight.b1.ffn = moe.MoELayer(D, FF, 8, **MOE).double()
    pipe8, opt8 = _pipeline((2, 1, 2), eight)
    before = _snapshot(pipe8.named_parameters(), opt8)
    out["other experts"] = _refused(lambda: load_checkpoint(a, pipe8, opt8))
    after = _snapshot(pipe8.named_parameters(), opt8)  # (torch's helper fills opt8's state)
    out["unchanged"] = all(torch.equal(after[k], v) for k, v in before.items())
    short = OrderedDict((n, c) for n, c in build_model().named_children() if n != "b3")
    pipe5, opt5 = _pipeline((2, 1, 2), nn.Sequential(short))
    out["other model"] = _refused(lambda: load_checkpoint(a, pipe5, opt5))
    # one optimizer value per group: stages with other learning rates cannot be saved
    odd = torch.optim.Adam(pipe.parameters(), lr=LR * (1 + rank // 2))
    listing = sorted(os.listdir(a))
    out["odd lr"] = _refused(lambda: save_checkpoint(a, pipe, odd))
    out["odd lr wrote nothing"] = sorted(os.listdir(a)) == listing
    dist.barrier()
    return out


def _second_body(rank, world, path):
    """(1, 1, 1)'s checkpoint C back at (2, 1, 2)."""
    pipe, opt = _pipeline((2, 1, 2))
    extra = load_checkpoint(os.path.join(path, "c"), pipe, opt)
    return extra, _snapshot(pipe.named_parameters(), opt)


def _union(per_rank: list[dict]) -> dict:
    """The ranks' snapshots as one (a stage's ranks hold the same values, checked)."""
    out = {}
    for snap in per_rank:
        for k, v in snap.items():
            if k in out:
                assert torch.equal(out[k], v), k
            out[k] = v
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _assert_equal(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), (what, got.keys() ^ want.keys())
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), (what, k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pipeline_ckpt"))
    first = run_ranks(_first_body, 4, path, timeout=120)
    snapshots = ("saved", "uninterrupted", "loaded", "resumed", "grouped")
    results = {k: _union([r[k] for r in first]) for k in first[0] if k.startswith(snapshots)}
    results |= {k: first[0][k] for k in first[0] if k.startswith("extra")}
    results["ranks"] = first
    # (1, 1, 1): B into one process, which saves C; D (GroupedApply) into one process
    model = _fresh(build_model())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    results["extra 111"] = load_checkpoint(os.path.join(path, "b"), model, opt)
    results["loaded 111"] = _snapshot(model.named_parameters(), opt)
    save_checkpoint(os.path.join(path, "c"), model, opt, extra={"step": SAVED_AT})
    _train_one_process(model, opt, _batches()[SAVED_AT:])
    results["resumed 111"] = _snapshot(model.named_parameters(), opt)
    model = _fresh(build_model())
    grouped = GroupedApply(model.named_parameters(), torch.optim.Adam, 3, lr=LR)
    load_checkpoint(os.path.join(path, "d"), model, grouped)
    results["grouped 111"] = _snapshot(model.named_parameters(), grouped)
    model = _fresh(build_model())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    load_checkpoint(os.path.join(path, "e"), model, opt)
    results["loaded plain 111"] = _snapshot(model.named_parameters(), opt)
    second = run_ranks(_second_body, 4, path, timeout=120)
    results["extra back 212"] = second[0][0]
    results["loaded back 212"] = _union([s for _, s in second])
    results["path"] = path
    return results


def test_checkpoint_hops_across_pipeline_layouts_exactly(runs):
    saved = runs["saved"]
    assert any(k.endswith(" exp_avg_sq") for k in saved) and any(k.endswith(" step") for k in saved)
    assert {k.split()[1] for k in saved} == {n for n, _ in build_model().named_parameters()}
    # A (2,1,2) -> (2,1,2), (1,2,2), (2,2,1); (1,2,2) -> B -> (1,1,1) -> C -> (2,1,2)
    for name in ("212", "122", "221", "212 v2", "plain 122", "plain 111", "111", "back 212"):
        _assert_equal(runs[f"loaded {name}"], saved, name)
    for name in ("212", "122", "111", "back 212"):
        assert runs[f"extra {name}"] == {"step": SAVED_AT}, name
    # the metadata records the layout each was saved at
    for name, layout in (("a", (2, 1, 2)), ("b", (1, 2, 2)), ("c", (1, 1, 1)), ("e", (1, 2, 2))):
        _, objects = read_metadata_json(checkpoint_dir(os.path.join(runs["path"], name)))
        assert objects["layout"] == dict(zip(("pp", "dp", "ep"), layout)), name
        assert set(objects["moe_layers"]) == {"b1.ffn", "b3.ffn"}  # both stages' layers


def test_resumed_pipelined_run_equals_uninterrupted(runs):
    want = runs["uninterrupted"]
    _assert_equal(runs["resumed 212"], want, "same layout")  # bit for bit
    for name in ("122", "111"):  # other reduction orders
        got = runs[f"resumed {name}"]
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert _rel(got[k], v) <= 1e-12, (name, k, _rel(got[k], v))
    # the run moved: the resumed steps changed every parameter
    saved = runs["saved"]
    assert all(not torch.equal(want[k], saved[k]) for k in want if k.startswith("param "))


def test_grouped_apply_pipeline_checkpoint_loads_in_one_process(runs):
    _assert_equal(runs["grouped 111"], runs["grouped"], "GroupedApply")


def test_incompatible_checkpoints_are_refused_on_every_rank(runs):
    for rank, out in enumerate(runs["ranks"]):
        assert "checkpoint refused" in out["other experts"], out["other experts"]
        assert (
            "MoE layer 'b1.ffn': num_experts=4 in the checkpoint, num_experts=8"
            in (out["other experts"])
        ), out["other experts"]
        assert (
            "saved at (pp, dp, ep) = (2, 1, 2), this run is at (pp, dp, ep) = (2, 1, 2)"
            in (out["other experts"])
        )
        other = out["other model"]
        assert "MoE layer 'b3.ffn': in the checkpoint but not in the model" in other, other
        assert "model/b3.norm.weight: in the checkpoint but not in the model" in other
        assert "optim/b3.ffn.experts.w1/exp_avg: in the checkpoint but not a parameter" in other
        assert out["unchanged"], rank
        assert (
            "optimizer param_groups[0]: hyper-parameters differ across stages" in (out["odd lr"])
        ), out["odd lr"]
        assert out["odd lr wrote nothing"]
        assert out["other experts"] == runs["ranks"][0]["other experts"]  # the same everywhere


def test_malformed_layout_record_is_refused(runs, tmp_path):
    forged = tmp_path / "forged"
    shutil.copytree(checkpoint_dir(os.path.join(runs["path"], "c")), forged)
    raw = json.loads((forged / "metadata.json").read_text())
    raw["objects"]["layout"] = {"pp": 0, "dp": 1, "ep": 1}
    (forged / "metadata.json").write_text(json.dumps(raw))
    model = build_model()
    with pytest.raises(CheckpointError, match="objects.layout must map pp, dp, ep to ints >= 1"):
        load_checkpoint(str(forged), model)


def test_model_parts_and_bad_models_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="model must be an nn.Module or a moe.pipeline.Pipeline"):
        save_checkpoint(str(tmp_path), object())
    with pytest.raises(ValueError, match="model must be an nn.Module or a moe.pipeline.Pipeline"):
        load_checkpoint(str(tmp_path), [build_model()])
    with pytest.raises(ValueError, match="'b0' is in two parts"):
        model = build_model()
        ModelParts([nn.Sequential(OrderedDict(b0=model.b0)), model], {"pp": 2, "dp": 1, "ep": 1})
    with pytest.raises(ValueError, match="holds parameters or buffers of its own"):
        ModelParts([nn.Linear(2, 2)], {"pp": 1, "dp": 1, "ep": 1})
    assert list(os.listdir(tmp_path)) == []  # nothing written
