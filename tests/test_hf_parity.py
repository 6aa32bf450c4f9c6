"""from_hf / to_hf against transformers' own models (tiny configs, no downloads): logits in
eval and train mode and every gradient equal the original model's after from_hf; to_hf
round-trips the state dict exactly."""

import copy

import pytest
import torch

import moe

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

COMMON = dict(
    vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
)  # fmt: skip


def build(family: str, layers: int = 3):
    T = transformers
    COMMON = {**globals()["COMMON"], "num_hidden_layers": layers}
    if family == "mixtral":
        cfg = T.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=6)
        return T.MixtralForCausalLM(cfg)
    if family == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(
            **COMMON, intermediate_size=40, moe_intermediate_size=20, num_experts=6,
            shared_expert_intermediate_size=28, norm_topk_prob=False,
        )  # fmt: skip
        return T.Qwen2MoeForCausalLM(cfg)
    if family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(
            **COMMON, intermediate_size=40, moe_intermediate_size=20, num_experts=8,
            norm_topk_prob=True, head_dim=8,
        )  # fmt: skip
        return T.Qwen3MoeForCausalLM(cfg)
    if family == "olmoe":
        cfg = T.OlmoeConfig(**COMMON, intermediate_size=20, num_experts=6)
        return T.OlmoeForCausalLM(cfg)
    if family == "deepseek_v3":
        cfg = T.DeepseekV3Config(
            **{**COMMON, "num_experts_per_tok": 3, "num_key_value_heads": 4}, intermediate_size=40,
            moe_intermediate_size=12,
            n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        )  # fmt: skip
        return T.DeepseekV3ForCausalLM(cfg)
    raise AssertionError(family)


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


def fresh(family: str, layers: int = 3):
    torch.manual_seed(0)
    model = build(family, layers).float()
    with torch.no_grad():  # non-trivial routers, gates and correction biases
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "e_score_correction_bias" in name or name.endswith(
                ("gate.weight", "expert_gate.weight")
            ):
                t.copy_(torch.randn_like(t) * 0.5)
    return model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def hf_grads(model) -> dict:
    """Every parameter gradient under transformers' names (converted blocks mapped back)."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    for path, _layer in [
        (n, m) for n, m in model.named_modules() if isinstance(m, moe.interop.HFMoELayer)
    ]:
        g = {
            k.removeprefix(path + "."): grads.pop(k)
            for k in list(grads)
            if k.startswith(path + ".")
        }
        grads[f"{path}.gate.weight"] = g["router.weight"]
        grads[f"{path}.experts.gate_up_proj"] = torch.cat(
            [g["experts.w1"], g["experts.w3"]], 2
        ).transpose(1, 2)
        grads[f"{path}.experts.down_proj"] = g["experts.w2"].transpose(1, 2)
        shared = "shared_expert" if "shared_experts.gate.weight" in g else "shared_experts"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if f"shared_experts.{proj}.weight" in g:
                grads[f"{path}.{shared}.{proj}.weight"] = g[f"shared_experts.{proj}.weight"]
        if "shared_experts.gate.weight" in g:
            grads[f"{path}.shared_expert_gate.weight"] = g["shared_experts.gate.weight"]
    return grads


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_matches_transformers(family):
    reference = fresh(family)
    converted = moe.from_hf(copy.deepcopy(reference))
    assert moe.moe_layers(converted) and not moe.interop.hf_blocks(converted)
    ids = torch.randint(0, 97, (3, 11))
    for train in (False, True):
        reference.train(train)
        converted.train(train)
        for m in (reference, converted):
            m.zero_grad(set_to_none=True)
        out_ref = reference(ids, labels=ids)
        out = converted(ids, labels=ids)
        assert relative_error(out.logits, out_ref.logits) <= 1e-5, family
        out_ref.loss.backward()
        out.loss.backward()
        want = {n: p.grad for n, p in reference.named_parameters()}
        got = hf_grads(converted)
        assert set(got) == set(want)
        for name, g in want.items():
            if g is None:
                assert got[name] is None or not got[name].any(), name
                continue
            assert relative_error(got[name], g) <= 1e-5, (family, train, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_round_trips_the_state_dict(family):
    reference = fresh(family)
    state = reference.state_dict()
    model = moe.to_hf(moe.from_hf(copy.deepcopy(reference)))
    restored = model.state_dict()
    assert list(restored) == list(state)
    for key, value in state.items():
        assert restored[key].shape == value.shape and torch.equal(restored[key], value), key
    ids = torch.randint(0, 97, (2, 7))
    torch.testing.assert_close(
        model.eval()(ids).logits, reference.eval()(ids).logits, rtol=0, atol=0
    )


def test_unsupported_block_is_a_clear_error():
    class StrangeSparseBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 2)
            self.experts = torch.nn.Module()
            self.experts.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), StrangeSparseBlock())
    with pytest.raises(
        ValueError, match=r"1 \(StrangeSparseBlock\) is a sparse-MoE block of an unsupported"
    ):
        moe.from_hf(model)
    with pytest.raises(ValueError, match="no sparse-MoE block in Sequential: neither"):
        moe.from_hf(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_mixtral_input_jitter_matches_in_training():
    reference = fresh("mixtral")
    reference.config.router_jitter_noise = 0.2
    for layer in reference.model.layers:
        layer.mlp.jitter_noise = 0.2
    converted = moe.from_hf(copy.deepcopy(reference)).train()
    ids = torch.randint(0, 97, (2, 9))
    torch.manual_seed(5)
    want = reference.train()(ids).logits
    torch.manual_seed(5)
    got = converted(ids).logits
    assert relative_error(got, want) <= 1e-5
    torch.manual_seed(6)  # other noise: another output (the jitter is really applied)
    assert relative_error(converted(ids).logits, want) > 1e-4


def _aux_losses(family: str, layers: int):
    """(transformers' model, its output with output_router_logits=True, the converted model,
    moe.aux_loss of the converted one) for the same tokens, in training mode."""
    reference = fresh(family, layers).train()
    converted = moe.from_hf(copy.deepcopy(reference)).train()
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    out_ref = reference(ids, output_router_logits=True)
    converted(ids)
    return reference, out_ref, converted, moe.aux_loss(converted)


def _same_gradients(reference, converted, family):
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    for p in converted.parameters():  # the experts take no gradient from the aux loss
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    got = hf_grads(converted)
    assert any(n.endswith("gate.weight") for n in want), "no router gradient to compare"
    for name, g in want.items():
        assert relative_error(got[name], g) <= 1e-5, (family, name)
    for name, g in got.items():  # and none where transformers has none
        assert name in want or not g.any(), (family, name)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_aux_loss_and_its_gradient_equal_transformers_for_one_sparse_layer(family):
    """transformers' loss term router_aux_loss_coef * aux_loss (output_router_logits=True) and
    moe.aux_loss of the converted model: equal values, and equal gradients of every parameter
    (the routers and everything below them) -- issue 49 item 20."""
    reference, out_ref, converted, aux = _aux_losses(family, layers=1)
    coef = reference.config.router_aux_loss_coef
    assert coef > 0 and out_ref.aux_loss is not None
    expected = coef * out_ref.aux_loss
    assert abs(aux.item() - expected.item()) <= 1e-6 * expected.item(), (family, aux, expected)
    expected.backward()
    aux.backward()
    _same_gradients(reference, converted, family)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_aux_loss_of_several_layers_is_the_mean_of_transformers_per_layer_terms(family):
    """With L sparse layers transformers pools f and P over the layers; moe sums per-layer
    terms: coef * (mean over the layers of transformers' term of each layer alone), exactly,
    and near the pooled term (within 25 %: the layers' loads differ a little; a factor k or L
    off is not near)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    reference, out_ref, converted, aux = _aux_losses(family, layers=3)
    config = reference.config
    coef, E, k = config.router_aux_loss_coef, len(out_ref.router_logits[0][0]), 2
    assert len(out_ref.router_logits) == len(moe.moe_layers(converted)) == 3
    per_layer = [load_balancing_loss_func((g,), E, k) for g in out_ref.router_logits]
    expected = coef * sum(per_layer) / len(per_layer)
    assert abs(aux.item() - expected.item()) <= 1e-6 * expected.item(), (family, aux, expected)
    pooled = coef * out_ref.aux_loss
    assert abs(aux.item() - pooled.item()) <= 0.25 * pooled.item(), (family, aux, pooled)
    expected.backward()
    aux.backward()
    _same_gradients(reference, converted, family)


def test_deepseek_v3_has_no_aux_loss_on_either_side():
    """DeepSeek-V3 balances by its correction bias: transformers computes no aux loss, and the
    converted layers' coefficient is 0."""
    reference, out_ref, converted, aux = _aux_losses("deepseek_v3", layers=3)
    assert out_ref.aux_loss is None
    assert all(layer.config.aux_loss_coef == 0.0 for _, layer in moe.moe_layers(converted))
    assert aux.item() == 0.0


def test_the_sparse_layer_count_follows_the_config():
    """Qwen's mlp_only_layers / decoder_sparse_step leave some layers dense: the coefficient
    divides by the sparse layers transformers builds."""
    from moe.interop.hf_families import FAMILIES

    cfg = transformers.Qwen2MoeConfig(
        **{**COMMON, "num_hidden_layers": 4}, intermediate_size=40, moe_intermediate_size=20,
        num_experts=6, shared_expert_intermediate_size=28, decoder_sparse_step=2,
        mlp_only_layers=[3], router_aux_loss_coef=0.01,
    )  # fmt: skip
    model = transformers.Qwen2MoeForCausalLM(cfg)
    family = FAMILIES["Qwen2MoeSparseMoeBlock"]
    assert family.num_sparse_layers(cfg) == len(moe.interop.hf_blocks(model)) == 1
    assert family.aux_loss_coef(cfg) == pytest.approx(0.01 * 2 / 1)


def test_router_logits_of_a_converted_model_are_one_clear_error_until_to_hf():
    """transformers collects router logits from the gate modules from_hf replaced (it raised an
    IndexError deep in its loss): one ValueError naming what to use; to_hf brings them back."""
    model = fresh("mixtral")
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    moe.from_hf(model)
    with pytest.raises(ValueError, match=r"converted by moe.from_hf.*moe.aux_loss\(model\)"):
        model(ids, output_router_logits=True)
    model(ids)  # the default (the config's False) runs
    moe.to_hf(model)
    assert model(ids, output_router_logits=True).aux_loss is not None
