"""Tiny random models of every transformers family on the experts contract
(@use_experts_implementation), built from each family's own config class with its sizes
shrunk by name: the matrix tests' models (no downloads, a few layers, small widths)."""

import importlib
import os

import torch

SIZES = {  # attribute name -> tiny value (only where the config has it as an int)
    "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
    "intermediate_size": 24, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
    "expert_intermediate_size": 16, "ffn_hidden_size": 24, "intermediate_size_mlp": 24,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "moe_k": 2, "top_k": 2, "moe_topk": 2,
    "n_group": 4, "topk_group": 2, "n_groups": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "qk_head_dim": 16,
    "first_k_dense_replace": 1, "first_k_dense": 1, "moe_layer_start_index": 1,
    "depth": 2, "num_heads": 2, "out_hidden_size": 32, "embed_dim": 32,
    "max_position_embeddings": 256, "sliding_window": 16,
}  # fmt: skip
SUFFIXES = {"intermediate_size": 24, "hidden_size": 32, "head_dim": 8, "_heads": 2}
# model_type (of the config or a sub-config) -> fields its tiny model needs beyond SIZES:
# sizes its default leaves unset (None), and layer patterns that put attention and experts
# into two layers. Data only: nothing family-specific runs anywhere else.
CONFIGS = {
    "bailing_hybrid": {
        "num_experts_per_token": 2, "num_expert_group": 4, "expert_swiglu_limit_list": [0, 0],
        "share_expert_swiglu_limit_list": [0, 0],
    },
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"], "num_experts_per_tok": 2},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "flint": {"mlp_only_layers": [0]},
    "gemma4_text": {
        "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
        "moe_intermediate_size": 16, "vocab_size_per_layer_input": 128,
        "hidden_size_per_layer_input": 8, "per_layer_config": {},
    },
    "granitemoehybrid": {
        "layer_types": ["linear_attention", "full_attention"], "mamba_d_head": 32,
        "mamba_d_state": 16, "mamba_chunk_size": 16,
    },
    "hunyuan_v1_moe": {"head_dim": 8},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "kimi_linear": {"num_experts_per_token": 2, "topk_group": 1},
    "kolibri1_1": {
        "head_dim": 16, "mlp_only_layers": [0], "index_layers": [1], "kv_source_layers": [0, 1],
        "index_num_heads": 1,
    },
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
    "mimo_v2_flash": {"head_dim": 24, "num_key_value_heads": 2},
    "mistral4": {"head_dim": 16},
    "openai_privacy_filter": {"num_labels": 128},
    "qwen3_omni_moe_audio_encoder": {
        "num_mel_bins": 16, "encoder_layers": 1, "encoder_ffn_dim": 24, "d_model": 32,
        "output_dim": 32, "downsample_hidden_size": 8,
    },
    "qwen4_exp_text": {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
    "step3p5": {"sliding_window": 16},
}  # fmt: skip
# family -> the class to train where the rule of tiny_model does not find it (built on that
# class's own config): Inkling's model type is not registered under its folder's name,
# Qwen3-Omni-MoE's top model only generates (its thinker trains), the privacy filter is a
# token classifier (labels are its tokens: 128 classes)
MODELS = {
    "inkling": "InklingForCausalLM",
    "openai_privacy_filter": "OpenAIPrivacyFilterForTokenClassification",
    "qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration",
}


def _root() -> str:
    import transformers

    return os.path.join(os.path.dirname(transformers.__file__), "models")


def contract_families() -> list[str]:
    """Every model type whose modeling file declares experts with @use_experts_implementation."""
    root = _root()
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, f"modeling_{name}.py")
        if os.path.exists(path):
            with open(path) as f:
                if "@use_experts_implementation" in f.read():
                    out.append(name)
    return out


def shrink(config) -> None:
    """Set every size attribute SIZES names (recursively into sub-configs), in place."""
    from transformers import PretrainedConfig

    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            shrink(value)
        elif isinstance(value, int) and not isinstance(value, bool) and value:
            size = SIZES.get(key, next((v for k, v in SUFFIXES.items() if key.endswith(k)), None))
            if size is not None:
                setattr(config, key, size)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        vocab = getattr(config, "vocab_size", None)
        if isinstance(value, int) and vocab and value >= vocab:
            setattr(config, key, vocab - 1)
    layers = getattr(config, "num_hidden_layers", None)
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and layers and len(value) > layers and key.endswith("types"):
            kinds = list(dict.fromkeys(value))  # every kind of layer kept, the first ones first
            setattr(config, key, (kinds + value)[:layers] if len(kinds) <= layers else value)
    rope = getattr(config, "rope_parameters", None)
    wants_mrope = "mrope_section" in (getattr(config, "ignore_keys_at_rope_validation", ()) or ())
    if isinstance(rope, dict) and (isinstance(rope.get("mrope_section"), list) or wants_mrope):
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        half = int(dim * rope.get("partial_rotary_factor", 1.0)) // 2
        old = rope.get("mrope_section")
        q = half // 3  # none given: two equal sections, the last takes the rest
        new = [s * half // sum(old) for s in old] if old else [q, q, half - 2 * q]
        new[0] += half - sum(new)
        rope["mrope_section"] = new
    for key, value in CONFIGS.get(config.model_type, {}).items():
        setattr(config, key, value)


def tiny_model(family: str, dtype=torch.float32, seed: int = 0):
    """A tiny random model of `family` (its CausalLM, else ConditionalGeneration class), its
    experts on transformers' eager implementation."""
    from transformers import CONFIG_MAPPING

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if family in MODELS:
        cls = getattr(module, MODELS[family])
        config = cls.config_class()
    else:
        config = CONFIG_MAPPING[family]()
        composite = hasattr(config, "text_config") or hasattr(config, "thinker_config")
        last = "ForConditionalGeneration" if composite else "ForCausalLM"
        names = [n for n in dir(module) if n.endswith(("ForCausalLM", "ForConditionalGeneration"))]
        cls = getattr(module, min(names, key=lambda n: (not n.endswith(last), len(n))))
    shrink(config)
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    model.set_experts_implementation("eager")  # the reference (grouped_mm takes no float64)
    return model


# Families on the contract the walk cannot check, and why (the support table shows the reason).
NOT_BUILT = {
    "diffusion_gemma": "its only head (DiffusionGemmaForBlockDiffusion) denoises a canvas of "
    "decoder_input_ids and returns no loss (labels are ignored): no training step to compare",
}


def experts_modules(model) -> list:
    """Every experts module on the contract (the decorator sets `_is_expert_parallel`)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """|a - b| / max(|b|, floor) (Frobenius norms)."""
    return float((a - b).detach().norm() / max(float(b.detach().norm()), floor, 1e-30))


def run(model, ids: torch.Tensor):
    """One training forward and backward (same seed every call: PhiMoE's router jitter)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def gradient_errors(got: dict, want: dict) -> dict:
    """Relative error of every gradient of `want` (name -> grad); a near-zero gradient (below
    1e-4 of the largest one, e.g. a hash-routed layer's gate, whose weights are constant) is
    compared against that floor instead of its own rounding noise."""
    floor = 1e-4 * max((float(g.norm()) for g in want.values() if g is not None), default=0.0)
    errors = {}
    for name, g in want.items():
        if g is None:
            errors[name] = 0.0 if got.get(name) is None else float(got[name].abs().max())
        else:
            errors[name] = relative_error(got[name], g, floor)
    return errors
