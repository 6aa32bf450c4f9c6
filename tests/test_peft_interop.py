"""moe.interop.to_peft / from_peft against PEFT's real classes on transformers' own models
(tiny Qwen3-MoE, Mixtral, OLMoE configs, float32): an adapter trained here loads with
peft.PeftModel.from_pretrained and gives the same logits; an adapter trained with PEFT reads
back here with the same logits; merge + to_hf keeps them; bad adapters are refused before any
weight changes."""

import copy
import json
import os

import pytest
import torch

import moe
from moe.interop import PeftAdapterError, from_peft, peft_lora_config, to_peft
from moe.interop import peft_layout as L
from moe.lora import LoRAConfig, adapter_parameters, add_lora, merge

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

COMMON = dict(
    vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2,
)  # fmt: skip
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ALL = ("w1", "w2", "w3")


def build(family: str, experts: int = 6):
    T = transformers
    torch.manual_seed(0)
    if family == "mixtral":
        m = T.MixtralForCausalLM(
            T.MixtralConfig(**COMMON, intermediate_size=12, num_local_experts=experts)
        )
    elif family == "qwen3_moe":
        m = T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(
                **COMMON,
                intermediate_size=40,
                moe_intermediate_size=12,
                num_experts=experts,
                norm_topk_prob=True,
                head_dim=6,
            )  # fmt: skip
        )
    elif family == "qwen2_moe":  # a shared expert with its sigmoid gate
        m = T.Qwen2MoeForCausalLM(
            T.Qwen2MoeConfig(
                **COMMON,
                intermediate_size=40,
                moe_intermediate_size=12,
                num_experts=experts,
                shared_expert_intermediate_size=20,
                norm_topk_prob=False,
            )  # fmt: skip
        )
    elif family == "deepseek_v3":  # layer 0 a dense MLP, layer 1 shared + routed experts
        m = T.DeepseekV3ForCausalLM(
            T.DeepseekV3Config(
                **{**COMMON, "num_key_value_heads": 4},
                intermediate_size=40,
                moe_intermediate_size=12,
                n_routed_experts=experts,
                n_group=2,
                topk_group=1,
                n_shared_experts=2,
                first_k_dense_replace=1,
                routed_scaling_factor=2.5,
                kv_lora_rank=16,
                q_lora_rank=24,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
            )  # fmt: skip
        )
    else:
        m = T.OlmoeForCausalLM(T.OlmoeConfig(**COMMON, intermediate_size=12, num_experts=experts))
    m = m.float().eval()
    with torch.no_grad():  # routers that spread the tokens
        for n, p in m.named_parameters():
            if n.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
    return m


def ids(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, COMMON["vocab_size"], (3, 9), generator=g)


def train(model, params, steps: int = 3, lr: float = 0.5) -> None:
    """A few SGD steps so that every B is far from zero."""
    opt = torch.optim.SGD(params, lr=lr)
    model.train()
    for step in range(steps):
        x = ids(100 + step)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        if any(isinstance(m, moe.MoELayer) for m in model.modules()):
            moe.parallel.sum_replica_grads(model)  # spare slots: copies stay equal
        opt.step()
    model.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(ids()).logits


def ours_trained(family, targets=ALL, spare_slots=0, rank=2, alpha=3.0, router=False):
    base = build(family)
    model = moe.from_hf(copy.deepcopy(base), spare_slots=spare_slots)
    shared = family in ("qwen2_moe", "deepseek_v3")
    config = LoRAConfig(
        rank=rank, alpha=alpha, targets=targets, router=router, shared_experts=shared
    )
    add_lora(model, config)
    train(model, [p for _, p in adapter_parameters(model)])
    with torch.no_grad():
        for n, p in adapter_parameters(model):
            assert p.abs().max() > 0, n  # trained: B is not zero
            # and large enough to move every logit (each expert's copies alike)
            if ".experts." not in n:  # the router's, shared experts': not per slot
                p.add_(torch.randn_like(p) * 0.3)
                continue
            layer = model.get_submodule(n.rpartition(".experts.")[0])
            noise_E = torch.randn_like(p[layer.slot_of_expert_E]) * 0.3
            p.add_(noise_E[layer.expert_of_slot()])
    return base, model


def peft_trained(family, folder, r=2, alpha=5, experts=6, targets=TARGETS, modules=()):
    base = build(family, experts)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(modules), target_parameters=list(targets),
        init_lora_weights=False,
    )  # fmt: skip
    pm = peft.get_peft_model(copy.deepcopy(base), config)
    train(pm, [p for p in pm.parameters() if p.requires_grad], lr=0.1)
    pm.save_pretrained(folder)
    return base, pm


# -- the layout, per parameter, against PEFT's ParamWrapper.get_delta_weight (float64) -------
def test_layout_is_peft_delta_weight():
    base = build("qwen3_moe").double()
    config = peft.LoraConfig(
        r=3, lora_alpha=7, target_modules=[], target_parameters=TARGETS, init_lora_weights=False
    )
    pm = peft.get_peft_model(base, config)
    outer = pm.base_model.model.model.layers[0].mlp.experts  # down_proj; base_layer: gate_up
    E, F = 6, 12
    for wrapper, name in ((outer.base_layer, L.GATE_UP), (outer, L.DOWN)):
        assert wrapper.parameter_name == name
        a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        s = wrapper.scaling["default"]
        want = wrapper.get_delta_weight("default")  # [E, out, in] as the parameter
        if name == L.GATE_UP:
            got = L.gate_up_from_peft(a, b, E, F, 3, {"w1", "w3"})
            d1 = torch.bmm(*got["w1"]) * s  # [E, d, F]: x @ W orientation
            d3 = torch.bmm(*got["w3"]) * s
            torch.testing.assert_close(torch.cat([d1, d3], 2).transpose(1, 2), want)
            back_a, back_b = L.gate_up_to_peft(*got["w1"], *got["w3"])  # rank 6, block-diag
            assert back_a.shape == (E * 6, 24) and back_b.shape == (2 * F, 6 * E)
            # the export against PEFT itself (not only our reader): rank 6, alpha 14, as
            # to_peft writes it, gives PEFT's delta of the rank-3 adapter
            six = peft.LoraConfig(r=6, lora_alpha=14, target_modules=[], target_parameters=TARGETS)
            pm6 = peft.get_peft_model(build("qwen3_moe").double(), six)
            w6 = pm6.base_model.model.model.layers[0].mlp.experts.base_layer
            with torch.no_grad():
                w6.lora_A["default"].weight.copy_(back_a)
                w6.lora_B["default"].weight.copy_(back_b)
            torch.testing.assert_close(w6.get_delta_weight("default"), want)
            split = L.gate_up_from_peft(back_a, back_b, E, F, 3, {"w1", "w3"})
            for t in ("w1", "w3"):
                torch.testing.assert_close(torch.bmm(*split[t]), torch.bmm(*got[t]))
        else:
            A, B = L.down_from_peft(a, b, E, 3)
            torch.testing.assert_close((torch.bmm(A, B) * s).transpose(1, 2), want)
            back = L.down_to_peft(A, B)
            assert torch.equal(back[0], a) and torch.equal(back[1], b)


# -- ours -> PEFT --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, targets, spare, router",
    [
        ("qwen3_moe", ALL, 0, False),
        ("mixtral", ALL, 2, False),  # spare slots: canonical expert order written
        ("olmoe", ALL, 0, True),  # the router's adapter too (PEFT: mlp.gate.weight)
        ("qwen3_moe", ("w3",), 0, False),  # gate_up_proj alone, up half only
        ("qwen3_moe", ("w1", "w3"), 0, False),  # gate_up_proj alone at rank 2r: lora_alpha 2a
        ("qwen3_moe", ("w1", "w2"), 0, True),
        ("qwen2_moe", ALL, 0, True),  # shared expert adapters: their nn.Linear weights
        ("deepseek_v3", ALL, 0, True),  # the same where PEFT converts v4 target_modules
    ],
)
def test_exported_adapter_loads_in_peft(tmp_path, family, targets, spare, router):
    base, model = ours_trained(family, targets, spare_slots=spare, router=router)
    config = to_peft(model, str(tmp_path), base)
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert config["lora_dropout"] == 0.0
    # shared experts as parameters (`target_modules` ending in gate_proj / up_proj / down_proj
    # are taken by PEFT's v4 -> v5 conversion for DeepSeek-V3 and dropped)
    assert config["target_modules"] == []
    shared = [t for t in config["target_parameters"] if "shared_expert" in t]
    assert len(shared) == {"qwen2_moe": 6, "deepseek_v3": 3}.get(family, 0)  # MoE layers x 3
    assert all(
        t.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")) for t in shared
    )
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()
    ours, theirs, plain = logits(model), logits(pm), logits(base)
    assert (ours - plain).abs().max() > 1e-3  # the adapter changes the function
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    if shared:  # and PEFT applied the shared experts' adapters: without them it differs
        unshared = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in adapter_parameters(unshared):
                if "shared_experts" in n and "lora_B" in n:
                    p.zero_()
        assert (logits(unshared) - ours).abs().max() > 1e-3
    # and it reads back here exactly (rank 2r gate_up with a block-diagonal B is split)
    again = moe.from_hf(copy.deepcopy(base), spare_slots=spare)
    add_lora(again, LoRAConfig(**peft_lora_config(str(tmp_path))))
    from_peft(again, str(tmp_path))
    torch.testing.assert_close(logits(again), ours, atol=1e-5, rtol=0)


# -- PEFT -> ours --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family, router", [("qwen3_moe", False), ("mixtral", True), ("olmoe", False)]
)
def test_peft_trained_adapter_reads_back(tmp_path, family, router):
    targets = [*TARGETS, "mlp.gate.weight"] if router else TARGETS
    base, pm = peft_trained(family, str(tmp_path), targets=targets)
    lora = peft_lora_config(str(tmp_path))
    assert lora == {
        "rank": 2, "alpha": 5.0, "targets": ALL, "router": router, "shared_experts": False
    }  # fmt: skip
    model = moe.from_hf(copy.deepcopy(base))
    add_lora(model, LoRAConfig(**lora))
    from_peft(model, str(tmp_path))
    torch.testing.assert_close(logits(model), logits(pm.eval()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("as_params", [False, True])
def test_peft_trained_shared_expert_adapter_reads_back(tmp_path, as_params):
    """PEFT's LoRA on the shared experts' nn.Linear, targeted as modules or as weights."""
    modules = [f"shared_expert.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
    targets = [*TARGETS, *(f"{m}.weight" for m in modules)] if as_params else TARGETS
    base, pm = peft_trained(
        "qwen2_moe", str(tmp_path), targets=targets, modules=() if as_params else modules
    )
    lora = peft_lora_config(str(tmp_path))
    assert lora["shared_experts"] and lora["targets"] == ALL
    model = moe.from_hf(copy.deepcopy(base))
    add_lora(model, LoRAConfig(**lora))
    from_peft(model, str(tmp_path))
    torch.testing.assert_close(logits(model), logits(pm.eval()), atol=1e-5, rtol=0)


def test_other_alpha_is_folded_and_missing_targets_add_nothing(tmp_path):
    """A model alpha other than PEFT's: B carries the ratio; a model projection the adapter
    leaves out (w2 here) gets B = 0, as PEFT computes without it."""
    base, pm = peft_trained("qwen3_moe", str(tmp_path), targets=TARGETS[:1])
    model = moe.from_hf(copy.deepcopy(base))
    add_lora(model, LoRAConfig(rank=2, alpha=1.0))
    train(model, [p for _, p in adapter_parameters(model)], steps=1)  # w2's B non-zero first
    from_peft(model, str(tmp_path))
    assert not model.model.layers[0].mlp.experts.lora_B_w2.any()
    torch.testing.assert_close(logits(model), logits(pm.eval()), atol=1e-5, rtol=0)


def test_merge_then_to_hf_writes_the_merged_model(tmp_path):
    base, pm = peft_trained("qwen3_moe", str(tmp_path / "adapter"))
    model = moe.from_hf(copy.deepcopy(base))
    add_lora(model, LoRAConfig(**peft_lora_config(str(tmp_path / "adapter"))))
    from_peft(model, str(tmp_path / "adapter"))
    unmerged = logits(model)
    merge(model)
    torch.testing.assert_close(logits(model), unmerged, atol=1e-5, rtol=0)
    moe.to_hf(model).save_pretrained(tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(reloaded.float().eval()), unmerged, atol=1e-5, rtol=0)
    peft_merged = pm.merge_and_unload()  # PEFT's own merge agrees
    torch.testing.assert_close(logits(peft_merged.eval()), unmerged, atol=1e-5, rtol=0)


# -- refusals: a clear error, the model unchanged --------------------------------------------
def _model_for(family="qwen3_moe", experts=6, rank=2):
    model = moe.from_hf(build(family, experts))
    add_lora(model, LoRAConfig(rank=rank, alpha=5.0))
    return model


def _refused(model, folder, match):
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(PeftAdapterError, match=match):
        from_peft(model, folder)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.fixture(scope="module")
def qwen_adapter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter")
    peft_trained("qwen3_moe", str(folder))
    return folder


def _edited(qwen_adapter, tmp_path, **changes):
    folder = tmp_path / "edited"
    folder.mkdir()
    doc = json.loads((qwen_adapter / "adapter_config.json").read_text())
    doc.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(doc))
    weights = (qwen_adapter / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return str(folder)


def test_refuses_another_expert_count(qwen_adapter):
    _refused(_model_for(experts=4), str(qwen_adapter), "6 experts; the model's layer has 4")


def test_rank_mismatch_names_no_fraction_of_an_expert(qwen_adapter, tmp_path):
    folder = _edited(qwen_adapter, tmp_path, r=5)  # 12 rows of lora_A: 6 experts at rank 2
    with pytest.raises(PeftAdapterError, match="not a whole number of experts") as e:
        from_peft(_model_for(rank=5), folder)
    assert "2.4" not in str(e.value)


def test_peft_fused_v4_targets_read_back(tmp_path):
    """PEFT given transformers v4 targets (gate_proj, up_proj, down_proj) fuses gate and up into
    gate_up_proj at twice the rank and writes rank_pattern {".*\\.gate_up_proj": 2r}: read at
    rank 2r, down_proj zero-padded, the PeftModel's logits."""
    modules = ["gate_proj", "up_proj", "down_proj"]
    base, pm = peft_trained("qwen3_moe", str(tmp_path), targets=[], modules=modules)
    doc = json.loads((tmp_path / "adapter_config.json").read_text())
    assert doc["rank_pattern"] == {".*\\.gate_up_proj": 4}  # PEFT's rewrite, as it writes it
    lora = peft_lora_config(str(tmp_path))
    assert (lora["rank"], lora["alpha"], lora["targets"]) == (4, 10.0, ALL)
    model = moe.from_hf(copy.deepcopy(base))
    add_lora(model, LoRAConfig(**lora))
    from_peft(model, str(tmp_path))
    torch.testing.assert_close(logits(model), logits(pm.eval()), atol=1e-5, rtol=0)


def test_refuses_another_model(qwen_adapter):
    _refused(_model_for("olmoe"), str(qwen_adapter), "for a Qwen3MoeForCausalLM")


def test_refuses_another_rank(qwen_adapter):
    _refused(_model_for(rank=3), str(qwen_adapter), "rank 2; the model's expert LoRA has rank 3")


def test_refuses_a_target_matching_nothing(qwen_adapter, tmp_path):
    folder = _edited(qwen_adapter, tmp_path, target_parameters=[*TARGETS, "mlp.experts.w9"])
    _refused(_model_for(), folder, r"targets \['mlp.experts.w9'\] match no adapted parameter")


def test_refuses_attention_lora_and_other_shapes(qwen_adapter, tmp_path):
    folder = _edited(qwen_adapter, tmp_path, target_modules=["q_proj"])
    _refused(_model_for(), folder, "target_modules adapt model.layers.0.self_attn.q_proj")
    os.remove(os.path.join(folder, "adapter_config.json"))
    doc = json.loads((qwen_adapter / "adapter_config.json").read_text())
    doc["rank_pattern"] = {"(a+)+$": 2}  # a regular expression: not read
    (tmp_path / "edited" / "adapter_config.json").write_text(json.dumps(doc))
    _refused(_model_for(), folder, r"is a regular expression, not read: only plain dotted names")


def test_refuses_a_bad_weights_file(qwen_adapter, tmp_path):
    folder = _edited(qwen_adapter, tmp_path)
    path = tmp_path / "edited" / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")  # a header longer than the file
    path.write_bytes(bytes(data))
    _refused(_model_for(), folder, "header length")
    os.remove(path)
    _refused(_model_for(), folder, "no such file")


def test_refuses_non_finite_factors(qwen_adapter, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _edited(qwen_adapter, tmp_path)
    path = os.path.join(folder, "adapter_model.safetensors")
    tensors = load_file(path)
    key = sorted(tensors)[-1]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, path)
    _refused(_model_for(), folder, "NaN or Inf in its factors")


def test_refuses_a_model_without_lora(qwen_adapter):
    with pytest.raises(PeftAdapterError, match="add_lora"):
        from_peft(moe.from_hf(build("qwen3_moe")), str(qwen_adapter))


# -- expert parallelism: the adapters sharded over 2 gloo ranks ------------------------------
def _ep_body(rank, world, folder, out):
    model = moe.from_hf(build("qwen3_moe"))
    add_lora(model, LoRAConfig(**peft_lora_config(folder)))
    moe.parallel.parallelize(model, moe.parallel.init_mesh(dp=1, ep=world))
    from_peft(model, folder)  # each rank takes its experts' slice
    to_peft(model, out)  # gathered; rank 0 writes
    return logits(model)


def test_under_expert_parallelism_read_and_written(tmp_path):
    from tests.distributed import run_ranks

    base, pm = peft_trained("qwen3_moe", str(tmp_path / "in"))
    got = run_ranks(_ep_body, 2, str(tmp_path / "in"), str(tmp_path / "out"), timeout=300)
    want = logits(pm.eval())
    for rank_logits in got:
        torch.testing.assert_close(rank_logits, want, atol=1e-5, rtol=0)
    written = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert written["auto_mapping"]["base_model_class"] == "Qwen3MoeForCausalLM"  # not FSDP's
    again = peft.PeftModel.from_pretrained(build("qwen3_moe"), str(tmp_path / "out")).eval()
    torch.testing.assert_close(logits(again), want, atol=1e-5, rtol=0)
