"""swap_ffn on transformers' real dense models (tiny configs, no downloads): upcycled outputs
equal the dense model's, training runs, weights + saved MoE settings rebuild the same model."""

import pytest
import torch
from torch import nn

import moe
from moe.convert.ffn_match import activation_name

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

T = transformers
D, F = 16, 40  # hidden and intermediate widths
FAMILIES = ["llama", "mistral", "qwen2", "gpt2", "bert", "roberta", "vit", "t5"]


def build(family: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=50, hidden_size=D, intermediate_size=F, num_hidden_layers=2)
    common.update(num_attention_heads=2)
    if family in ("llama", "mistral", "qwen2"):
        config_cls, model_cls = {
            "llama": (T.LlamaConfig, T.LlamaForCausalLM),
            "mistral": (T.MistralConfig, T.MistralForCausalLM),
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        }[family]
        return model_cls(config_cls(**common, num_key_value_heads=1, **overrides))
    if family == "gpt2":
        config = T.GPT2Config(vocab_size=50, n_embd=D, n_layer=2, n_head=2, n_inner=F)
        config.update(dict(n_positions=16, bos_token_id=0, eos_token_id=0, **overrides))
        return T.GPT2LMHeadModel(config)
    if family == "bert":
        return T.BertModel(T.BertConfig(**common, max_position_embeddings=16, **overrides))
    if family == "roberta":
        return T.RobertaModel(T.RobertaConfig(**common, max_position_embeddings=20, **overrides))
    if family == "vit":
        del common["vocab_size"]
        return T.ViTModel(T.ViTConfig(**common, image_size=8, patch_size=4, **overrides))
    if family == "t5":
        options = dict(d_kv=8, num_layers=2, num_heads=2, dropout_rate=0.0) | overrides
        return T.T5Model(T.T5Config(vocab_size=50, d_model=D, d_ff=F, **options))
    raise AssertionError(family)


def inputs(family: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if family == "vit":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    ids = torch.randint(0, 50, (2, 7), generator=g)
    if family == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids}


def run(model: nn.Module, family: str) -> torch.Tensor:
    out = model(**inputs(family))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


EXPECTED_LAYERS = {
    "llama": ("model.layers.0.mlp", "swiglu"),
    "mistral": ("model.layers.0.mlp", "swiglu"),
    "qwen2": ("model.layers.0.mlp", "swiglu"),
    "gpt2": ("transformer.h.0.mlp.c_fc", "gelu_tanh"),
    "bert": ("encoder.layer.0.intermediate", "gelu"),
    "roberta": ("encoder.layer.0.intermediate", "gelu"),
    "vit": ("layers.0.mlp", "gelu"),
    "t5": ("encoder.block.0.layer.1.DenseReluDense", "relu"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_upcycled_model_equals_dense_trains_and_reloads(family, tmp_path):
    model = build(family)
    model.eval()
    with torch.no_grad():
        dense_eval = run(model, family)
    model.train()
    torch.manual_seed(5)  # dropout draws the same masks in the same order after the swap
    with torch.no_grad():
        dense_train = run(model, family)

    moe.swap_ffn(model, num_experts=4, top_k=2, upcycle=True)
    layers = moe.moe_layers(model)
    first, activation = EXPECTED_LAYERS[family]
    assert layers[0][0] == first and layers[0][1].config.activation == activation
    assert len(layers) == (4 if family == "t5" else 2)
    assert all(m.config.normalize_weights for _, m in layers)
    torch.manual_seed(5)
    with torch.no_grad():
        torch.testing.assert_close(run(model, family), dense_train, rtol=1e-5, atol=1e-5)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(run(model, family), dense_eval, rtol=1e-5, atol=1e-5)

    # one training step: finite loss, gradients reach the experts
    model.train()
    out = run(model, family)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    loss = (out * target).mean() + moe.aux_loss(model)
    assert torch.isfinite(loss)
    loss.backward()
    for name, layer in layers:
        assert layer.experts.w1.grad.abs().sum() > 0, name
        assert layer.experts.w2.grad.abs().sum() > 0, name
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    model.eval()
    with torch.no_grad():
        trained = run(model, family)
    assert not torch.allclose(trained, dense_eval)

    # weights (safetensors) + MoE settings -> a freshly built dense model rebuilt and loaded
    safetensors_torch.save_model(model, str(tmp_path / "model.safetensors"))
    moe.save_moe_settings(model, tmp_path)
    fresh = moe.swap_ffn_from_settings(build(family), tmp_path)
    assert [n for n, _ in moe.moe_layers(fresh)] == [n for n, _ in layers]
    safetensors_torch.load_model(fresh, str(tmp_path / "model.safetensors"))
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(run(fresh, family), trained)

    # the trap of the issue: the same swap_ffn call minus upcycle computes something else
    other = moe.swap_ffn(build(family), num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=r"normalize_weights=False differs .* saved"):
        moe.check_moe_settings(other, tmp_path)
    with pytest.raises(ValueError, match="normalize_weights"):
        moe.swap_ffn_from_settings(other, tmp_path)


def test_save_pretrained_directory_round_trip(tmp_path):
    model = moe.swap_ffn(build("llama"), num_experts=4, top_k=2, capacity_factor=1.5)
    model.save_pretrained(tmp_path)
    moe.save_moe_settings(model, tmp_path)
    fresh = build("llama", tie_word_embeddings=model.config.tie_word_embeddings)
    moe.swap_ffn_from_settings(fresh, tmp_path)
    safetensors_torch.load_model(fresh, str(tmp_path / "model.safetensors"))
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(run(fresh, "llama"), run(model, "llama"))
    assert fresh.model.layers[1].mlp.config.capacity_factor == 1.5


def test_gpt2_swap_does_not_depend_on_the_dropout_rate(tmp_path):
    model = moe.swap_ffn(build("gpt2", resid_pdrop=0.0), num_experts=4, top_k=2, upcycle=True)
    moe.save_moe_settings(model, tmp_path)
    fresh = moe.swap_ffn_from_settings(build("gpt2"), tmp_path)  # resid_pdrop=0.1
    assert set(fresh.state_dict()) == set(model.state_dict())


def test_settings_errors_name_what_is_wrong(tmp_path):
    model = moe.swap_ffn(build("llama"), num_experts=4, top_k=2)
    path = moe.save_moe_settings(model, tmp_path)
    with pytest.raises(ValueError, match="no MoE settings file"):
        moe.swap_ffn_from_settings(build("llama"), tmp_path / "missing")
    with pytest.raises(ValueError, match="has no MoELayer"):
        moe.save_moe_settings(build("llama"), tmp_path / "dense")
    text = path.read_text()
    path.write_text(text.replace('"top_k"', '"top_kk"'))
    with pytest.raises(
        ValueError, match=r"missing fields \['top_k'\], unknown fields \['top_kk'\]"
    ):
        moe.swap_ffn_from_settings(build("llama"), tmp_path)
    path.write_text(text.replace('"num_experts": 4', '"num_experts": -4'))
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        moe.swap_ffn_from_settings(build("llama"), tmp_path)
    path.write_text(text.replace('"model.layers.1.mlp"', '"model.layers.7.mlp"'))
    dense = build("llama")
    with pytest.raises(ValueError, match="'model.layers.7.mlp': saved MoE block not found"):
        moe.swap_ffn_from_settings(dense, tmp_path)
    assert not moe.moe_layers(dense)  # nothing changed before the error
    path.write_text(text.replace('"d_ff": 40', '"d_ff": 48'))
    with pytest.raises(ValueError, match="saved d_ff=48 but the dense block has d_ff=40"):
        moe.swap_ffn_from_settings(build("llama"), tmp_path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        moe.swap_ffn_from_settings(build("llama"), tmp_path)


def test_predicate_accepts_transformers_blocks_and_reports_what_it_found():
    model = moe.swap_ffn(
        build("llama"),
        num_experts=2,
        top_k=1,
        predicate=lambda n, m: type(m).__name__ == "LlamaMLP",
    )
    assert [n for n, _ in moe.moe_layers(model)] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    bert = moe.swap_ffn(build("bert"), num_experts=2, top_k=1, predicate=lambda n, m: n.endswith(
        "1.intermediate"
    ))  # fmt: skip
    assert [n for n, _ in moe.moe_layers(bert)] == ["encoder.layer.1.intermediate"]
    gpt2 = moe.swap_ffn(build("gpt2"), predicate=lambda n, m: type(m).__name__ == "GPT2MLP")
    assert len(moe.moe_layers(gpt2)) == 2

    match = (
        r"model.layers.0.self_attn: cannot convert LlamaAttention \(found q_proj: "
        r"Linear\[16->16\], k_proj: Linear\[16->8\]"
    )
    with pytest.raises(moe.ConversionError, match=match):
        moe.swap_ffn(build("llama"), predicate=lambda n, m: n == "model.layers.0.self_attn")
    with pytest.raises(moe.ConversionError, match="the root has no parent"):
        moe.swap_ffn(build("llama"), predicate=lambda n, m: n == "")
    with pytest.raises(moe.ConversionError, match="predicate matched no module of BertModel"):
        moe.swap_ffn(build("bert"), predicate=lambda n, m: False)


def test_unconvertible_ffns_are_errors_saying_why():
    with pytest.raises(moe.ConversionError, match=r"gated MLP \(wi_0/wi_1/wo\) with activation "):
        moe.swap_ffn(build("t5", feed_forward_proj="gated-gelu"))
    with pytest.raises(
        moe.ConversionError, match=r"T5DenseActDense has dropout \{'dropout': 0.1\}"
    ):
        moe.swap_ffn(build("t5", dropout_rate=0.1))
    with pytest.raises(ValueError, match="upcycle=True needs normalize_weights=True"):
        moe.swap_ffn(build("llama"), upcycle=True, normalize_weights=False)
    with pytest.raises(moe.ConversionError, match="no dense FFN block found in Embedding"):
        moe.swap_ffn(nn.Embedding(4, 4))


def test_activations_are_recognised_by_what_they_compute():
    from transformers.activations import ACT2FN

    expected = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh"}
    expected |= {"gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "silu": "silu"}
    expected |= {"swish": "silu", "relu": "relu", "quick_gelu": None, "relu2": None}
    expected |= {"tanh": None, "sigmoid": None, "linear": None}
    assert {k: activation_name(ACT2FN[k]) for k in expected} == expected
    assert activation_name(nn.Dropout(0.0)) is None and activation_name(nn.PReLU()) is None


def test_activation_known_by_class_name_when_the_probe_cannot_run(monkeypatch):
    from transformers.activations import NewGELUActivation

    act = NewGELUActivation()
    monkeypatch.setattr(act, "forward", lambda x: (_ for _ in ()).throw(RuntimeError("cuda")))
    assert activation_name(act) == "gelu_tanh"
    assert activation_name(nn.Module()) is None  # forward not implemented, unknown class
