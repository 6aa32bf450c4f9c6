"""Hugging Face decoders in pipeline stages (moe.pipeline.hf_stack, save_hf; issue 47): real
transformers Qwen3-MoE and Mixtral models converted by moe.from_hf, split into stages and run
by moe.pipeline.Pipeline at (pp, dp, ep) = (2, 1, 2) and (2, 2, 1) on gloo, float64: logits,
losses, aux loss and every gradient equal the single-process converted model; the stages'
parameter names are the model's; save_hf writes what to_hf + save_pretrained writes. Also the
by-parameter split on hand-computed cases."""

import copy
import functools
import json
import os
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe
from moe.parallel import ParallelConfig
from moe.pipeline import (
    Pipeline,
    PipelineConfig,
    Rooted,
    build_stage,
    hf_stack,
    init_pipeline_mesh,
    plan_stages,
    save_hf,
)
from tests.distributed import run_ranks

transformers = pytest.importorskip("transformers")

V, S, ROWS, M, LR = 37, 5, 4, 2, 0.1  # vocabulary, tokens, rows per pipeline, micro-batches
COMMON = dict(
    vocab_size=V, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=32, num_experts_per_tok=2,
    router_aux_loss_coef=0.05, experts_implementation="eager",  # float64 experts
)  # fmt: skip


def build(family: str, convert: bool = True) -> nn.Module:
    """A tiny float64 causal LM, the same on every rank (Qwen3-MoE: layer 2 dense), with
    non-trivial routers; converted by moe.from_hf unless convert=False."""
    torch.manual_seed(0)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **COMMON, head_dim=8, intermediate_size=24, moe_intermediate_size=12, num_experts=4,
            norm_topk_prob=True, mlp_only_layers=[2],
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=12, num_local_experts=4)
        model = transformers.MixtralForCausalLM(cfg)
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p))
    if convert:
        moe.from_hf(model).double()  # routers in float64 too
    return model


def batches(width):
    """Two global batches of (tokens, targets): `width` pipelines x ROWS sequences."""
    g = torch.Generator().manual_seed(1)
    shape = (width * ROWS, S)
    return [
        (torch.randint(V, shape, generator=g), torch.randint(V, shape, generator=g))
        for _ in range(2)
    ]


def loss_fn(logits, target, scale):
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="sum") * scale


@functools.lru_cache
def reference(family, width, M=M):
    """One process, the converted model itself, the same micro-batches (as tests/
    test_pipeline.py): step 0's logits, losses, aux and grads, the parameters after one SGD
    step, and the model before / after it with its transformers blocks back (moe.to_hf)."""
    model = build(family)
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scale = 1 / (ROWS * S)
    x, y = batches(width)[0]
    outs, losses, auxes = [], [], []
    for r in range(width):
        out_r, loss_r, aux_r = [], [], 0.0
        rows = slice(r * ROWS, (r + 1) * ROWS)
        for xm, ym in zip(x[rows].tensor_split(M), y[rows].tensor_split(M)):
            out = model(input_ids=xm).logits
            loss, aux = loss_fn(out, ym, scale), moe.aux_loss(model)
            ((loss + aux / M) / width).backward()
            out_r.append(out.detach())
            loss_r.append(loss.detach())
            aux_r = aux_r + aux.detach() / M
        outs.append(torch.cat(out_r))
        losses.append(loss_r)
        auxes.append(aux_r)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return (outs, losses, auxes, grads), params, moe.to_hf(start), moe.to_hf(model)


class Case(NamedTuple):
    family: str
    pp: int
    dp: int
    ep: int
    data_parallel: str
    split: str = "children"
    M: int = M  # micro-batches


CASES = {
    "qwen3_pp2_dp1_ep2_fsdp": Case("qwen3_moe", 2, 1, 2, "fsdp"),
    "qwen3_pp2_dp2_ep1_fsdp": Case("qwen3_moe", 2, 2, 1, "fsdp"),
    "mixtral_pp2_dp1_ep2_ddp": Case("mixtral", 2, 1, 2, "ddp"),
    # by parameters: embed layer_0 | layer_1 | layer_2 (dense) | layer_3 head (by children:
    # embed layer_0 | layer_1 layer_2 | layer_3 | head); 1F1B takes at least pp micro-batches
    "qwen3_pp4_dp1_ep1_ddp_params": Case("qwen3_moe", 4, 1, 1, "ddp", "params", M=4),
}


@functools.lru_cache
def _mesh(pp, dp, ep):
    return init_pipeline_mesh(pp, dp, ep)


def _run_case(rank, case, folder):
    family, pp, dp, ep, data_parallel, split, M = case
    width = dp * ep
    stack = hf_stack(build(family))
    config = PipelineConfig("1F1B", microbatches=M, split=split)
    pipe = Pipeline(
        stack,
        _mesh(pp, dp, ep),
        config,
        functools.partial(loss_fn, scale=1 / (ROWS * S)),
        ParallelConfig(data_parallel, "flat"),
    )
    save_hf(pipe, stack, os.path.join(folder, "start"))  # before any step
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    x, y = batches(width)[0]
    rows = slice((rank % width) * ROWS, (rank % width + 1) * ROWS)
    out, losses = pipe.step(x[rows], y[rows])
    aux = pipe.aux_loss()
    grads = {n: p.grad.full_tensor() for n, p in pipe.named_parameters()}
    opt.step()
    params = {n: p.detach().full_tensor() for n, p in pipe.named_parameters()}
    save_hf(pipe, stack, os.path.join(folder, "stepped"))
    plan = [module.step_names for module in pipe.modules]
    return {
        "out": out,
        "losses": losses,
        "aux": aux,
        "grads": grads,
        "params": params,
        "plan": plan,
    }


def _body(rank, world, root):
    out = {}
    for name, case in CASES.items():
        out[name] = _run_case(rank, case, os.path.join(root, name))
    # a bad stack is one error on every rank
    try:
        save_hf("not a pipeline", None, os.path.join(root, "bad"))
    except ValueError as e:
        out["bad_export"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pipeline_hf"))
    return root, run_ranks(_body, 4, root, timeout=120)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("name", list(CASES))
def test_hf_pipeline_equals_one_process(results, name):
    _, ranks = results
    case = CASES[name]
    width = case.dp * case.ep
    (outs, losses, auxes, grads), params, _, _ = reference(case.family, width, case.M)
    names = set()
    for rank in range(4):
        got = ranks[rank][name]
        r = rank % width
        if got["out"] is not None:  # the last stage: merged logits and the micro-batch losses
            assert _rel(got["out"], outs[r]) <= 1e-12
            for a, b in zip(got["losses"], losses[r]):
                assert _rel(a, b) <= 1e-12
        assert _rel(got["aux"], torch.as_tensor(auxes[r], dtype=torch.float64)) <= 1e-12
        assert got["grads"], (rank, "no parameters")
        for n, g in got["grads"].items():  # the stages' names are the HF model's own
            assert _rel(g, grads[n]) <= 1e-12, (rank, n, _rel(g, grads[n]))
            assert _rel(got["params"][n], params[n]) <= 1e-12, (rank, n)
        names |= set(got["grads"])
    assert names == set(grads), sorted(set(grads) ^ names)
    assert sum(ranks[rank][name]["out"] is not None for rank in range(4)) == width
    # the plan (PipelineConfig.split): stage s on ranks s * width .. (s + 1) * width - 1
    plan = plan_stages(hf_stack(build(case.family)), case.pp, by=case.split)
    for rank in range(4):
        assert ranks[rank][name]["plan"] == [plan[rank // width]], (rank, plan)


def _tensors(folder):
    from safetensors.torch import load_file

    (file,) = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    return file, load_file(os.path.join(folder, file))


@pytest.mark.parametrize("name", list(CASES))
def test_save_hf_writes_what_to_hf_writes(results, name, tmp_path):
    root, _ = results
    case = CASES[name]
    _, _, start, stepped = reference(case.family, case.dp * case.ep, case.M)
    for label, model in (("start", start), ("stepped", stepped)):
        want_dir, got_dir = str(tmp_path / label), os.path.join(root, name, label)
        model.save_pretrained(want_dir)
        with (
            open(os.path.join(want_dir, "config.json")) as f,
            open(os.path.join(got_dir, "config.json")) as g,
        ):
            assert json.load(f) == json.load(g)
        with (
            open(os.path.join(want_dir, "generation_config.json")) as f,
            open(os.path.join(got_dir, "generation_config.json")) as g,
        ):
            assert f.read() == g.read()
        file, want = _tensors(want_dir)
        got_file, got = _tensors(got_dir)
        assert file == got_file and want.keys() == got.keys()
        # transformers' layout (its blocks back, saved as on the hub), not moe's
        assert any(k.startswith("model.layers.0.") and ".experts.0." in k for k in want)
        assert not any("experts.w1" in k or "router" in k for k in want)
        assert sorted(os.listdir(want_dir)) == sorted(os.listdir(got_dir))
        if label == "start":  # the same weights: the same bytes
            with (
                open(os.path.join(want_dir, file), "rb") as f,
                open(os.path.join(got_dir, file), "rb") as g,
            ):
                assert f.read() == g.read()
        for k in want:
            assert want[k].dtype == got[k].dtype and _rel(got[k], want[k]) <= 1e-12, k


def test_bad_export_is_one_error_on_every_rank(results):
    _, ranks = results
    for rank in range(4):
        assert "save_hf: pipe must be a Pipeline" in ranks[rank]["bad_export"]


def test_stack_is_the_model():
    """The stack computes the converted model's logits exactly (and the plain model's to
    float32 rounding: transformers' routers take a float32 softmax), holding its modules."""
    for family in ("qwen3_moe", "mixtral"):
        plain = build(family, convert=False)
        model = build(family)
        x = torch.randint(V, (3, S), generator=torch.Generator().manual_seed(2))
        stack = hf_stack(model)
        assert [n for n, _ in stack.named_children()] == [
            "embed", "layer_0", "layer_1", "layer_2", "layer_3", "head",
        ]  # fmt: skip
        logits = stack(x)
        assert torch.equal(logits, model(input_ids=x).logits)
        assert _rel(logits, plain(input_ids=x).logits) <= 1e-6
        # a stage of several children: the model's parameter names, the same objects
        stage = build_stage(stack, ["layer_1", "layer_2", "head"], aux_scale=1.0)
        mine = dict(model.named_parameters())
        got = dict(stage.named_parameters())
        assert got and all(p is mine[n] for n, p in got.items())
        assert {n.split(".")[2] for n in got if n.startswith("model.layers.")} == {"1", "2"}
        assert "lm_head.weight" in got and "model.norm.weight" in got
        assert set(stage.state_dict()) <= set(model.state_dict())


def test_hf_stack_refusals():
    cfg = transformers.Qwen3MoeConfig(**{**COMMON, "tie_word_embeddings": True}, num_experts=4)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        hf_stack(transformers.Qwen3MoeForCausalLM(cfg))
    with pytest.raises(ValueError, match="not a supported causal LM"):
        hf_stack(nn.Linear(2, 2))
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    stack = nn.Sequential(OrderedDict(x=Rooted({"m.f": a}), y=Rooted({"m.f": b})))
    with pytest.raises(ValueError, match="two different modules at m.f"):
        build_stage(stack, ["x", "y"], 1.0)


def test_hf_stack_split_by_params():
    # Qwen3-MoE stack: embed 37 x 16 = 592; attention 256 + 128 + 128 + 256 + 8 + 8 = 784 and
    # norms 32 per layer; MoE FFN 4 x 16 + 3 x 4 x 16 x 12 = 2368, dense FFN 3 x 16 x 24 = 1152;
    # head 16 + 592. Children: 592, 3184, 3184, 1968 (dense), 3184, 608.
    stack = hf_stack(build("qwen3_moe"))
    counts = [sum(p.numel() for p in child.parameters()) for child in stack.children()]
    assert counts == [592, 3184, 3184, 1968, 3184, 608]
    # 4 stages: by children the largest is 3184 + 1968 = 5152; by parameters 3184 + 608
    assert plan_stages(stack, 4) == [
        ["embed", "layer_0"],
        ["layer_1", "layer_2"],
        ["layer_3"],
        ["head"],
    ]
    assert plan_stages(stack, 4, by="params") == [
        ["embed", "layer_0"], ["layer_1"], ["layer_2"], ["layer_3", "head"],
    ]  # fmt: skip


def test_stack_is_every_family():
    """Every family from_hf reads (transformers' tiny float32 models of tests/test_hf_parity.py),
    plain and converted: the stack's logits are the model's, bit for bit (each family's own
    mask choice: Qwen2-MoE by layer_types, Mixtral / Qwen3-MoE by sliding_window)."""
    from tests.test_hf_parity import FAMILIES, fresh

    for family in FAMILIES:
        model = fresh(family)
        x = torch.randint(
            model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4)
        )
        for _ in ("plain", "converted"):
            with torch.no_grad():
                assert torch.equal(hf_stack(model)(x), model(input_ids=x).logits), family
            if not moe.interop.hf_blocks(model):
                break
            moe.from_hf(model)
        assert hf_stack(model).hf_options == {"spare_slots": 0}


def test_export_rebuilds_spare_slots(tmp_path):
    """save_hf's writer on rank 0 (one process here): a model converted with spare expert
    slots is rebuilt with them, loaded from the gathered state and written as to_hf writes."""
    from moe.pipeline.hf_export import _write

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=12, num_experts=4)
    model = moe.from_hf(transformers.Qwen3MoeForCausalLM(cfg).double(), spare_slots=2)
    stack = hf_stack(model)
    assert stack.hf_options == {"spare_slots": 2}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    _write(stack, dict(model.state_dict()), str(tmp_path / "got"), {})
    moe.to_hf(model).save_pretrained(str(tmp_path / "want"))
    for name in ("config.json", "model.safetensors"):
        with open(tmp_path / "got" / name, "rb") as f, open(tmp_path / "want" / name, "rb") as g:
            assert f.read() == g.read(), name


def test_generic_stack_refusals():
    """hf_stack runs the model's own forward around its layers (moe.pipeline.hf_layer_inputs):
    an embedding multiplier and a logit scale are the model's (Granite), a multimodal model's
    text path is the model's; what the stack cannot carry is one error naming why: a vision
    tower outside it (unless text_only), layers handing more than the hidden state on, a layer
    taking the token ids (hash routing)."""
    from tests.hf_tiny import tiny_model

    x = torch.randint(97, (2, 6), generator=torch.Generator().manual_seed(5))
    vl = tiny_model("qwen3_vl_moe")
    with pytest.raises(ValueError, match=r"outside what the stack runs \(model.visual\)"):
        hf_stack(vl)
    stack = hf_stack(vl, text_only=True)
    assert stack.text_only and not any(".visual." in n for n, _ in stack.named_parameters())
    granite = tiny_model("granitemoe")
    granite.model.embedding_multiplier, granite.config.logits_scaling = 2.0, 3.0
    for model in (vl, granite):
        with torch.no_grad():
            assert torch.equal(hf_stack(model, text_only=True)(x), model(input_ids=x).logits)
    with pytest.raises(ValueError, match="pass more than the hidden state on"):
        hf_stack(tiny_model("glm_moe_dsa"))
    with pytest.raises(ValueError, match=r"inputs \['input_ids'\] differ"):
        hf_stack(tiny_model("deepseek_v4"))
