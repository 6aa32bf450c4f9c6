"""Named model presets: the published configs (config.json fields, as the model cards give
them) the planner is checked against, and the M6 example's presets (`m6-tiny`, `m6-1t`, ...)."""

from __future__ import annotations

import importlib
from pathlib import Path

from moe.plan.built import build_config, count_params
from moe.plan.spec import ModelSpec, from_hf_config, from_planner_model
from moe.settings import check_path
from moe.untrusted import read_json

_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128)  # fmt: skip
# huggingface.co/<repo>/blob/main/config.json, read 2026-11-28
HF_CONFIGS: dict[str, dict] = {
    # deepseek-ai/DeepSeek-V3 (671B total, 37B active; the MTP module not counted)
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        **_MLA,
    ),  # fmt: skip
    # moonshotai/Kimi-K2-Instruct (1.04T total, 32B active); its config.json says "kimi_k2",
    # its architecture is DeepseekV3ForCausalLM (the type transformers builds it as)
    "kimi-k2": dict(
        model_type="deepseek_v3",
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=64,
        n_shared_experts=1,
        n_routed_experts=384,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        **_MLA,
    ),  # fmt: skip
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
    ),  # fmt: skip
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),  # fmt: skip
    # a Mixtral-shaped tiny config (the planner's measured runs on CPU)
    "mixtral-tiny": dict(
        model_type="mixtral",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),  # fmt: skip
}
_MAX_CONFIG_BYTES = 1 << 20
# The sizes a config.json may give (inclusive bounds): an integer outside them (or a string,
# a float, a missing required field) is one error naming the field before any search.
SIZE_BOUNDS = {
    "num_hidden_layers": (1, 1024),  # or what _layer_count reads
    "hidden_size": (1, 1 << 17),
    "vocab_size": (1, 1 << 22),
    "num_attention_heads": (1, 1024),
}
OPTIONAL_SIZE_BOUNDS = {
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (0, 1 << 20),
    "num_key_value_heads": (1, 1024),
    "head_dim": (0, 1 << 14),  # 0: not given (GLM-5-Next's default; hidden / heads)
    "num_experts": (0, 1 << 14),
    "num_local_experts": (0, 1 << 14),
    "n_routed_experts": (0, 1 << 14),
    "num_experts_per_tok": (1, 1 << 10),
    "n_shared_experts": (0, 1 << 10),
    "first_k_dense_replace": (0, 1024),
    "decoder_sparse_step": (1, 1024),
    "moe_layer_freq": (1, 1024),
    "q_lora_rank": (0, 1 << 17),
    "kv_lora_rank": (0, 1 << 17),
    "qk_nope_head_dim": (0, 1 << 14),
    "qk_rope_head_dim": (0, 1 << 14),
    "v_head_dim": (0, 1 << 14),
}
# fields a real family gives as a short list of sizes (ERNIE-4.5-VL: text and vision experts)
LIST_SIZES = {"moe_intermediate_size": 8}


def _layer_count(cfg: dict) -> tuple[str, object]:
    """The layer count of a config.json without num_hidden_layers (transformers 5 writes none
    where it is a property): LongCat-Flash's num_layers, Nemotron-H's len(layers_block_type)."""
    if "num_layers" in cfg:
        return "num_layers", cfg["num_layers"]
    kinds = cfg.get("layers_block_type")
    if isinstance(kinds, list):
        return "len(layers_block_type)", len(kinds)
    return "num_hidden_layers", None


def check_config(doc: dict, where: str) -> None:
    """Every size field of a config.json (its text_config, for a nested one) an integer within
    SIZE_BOUNDS / OPTIONAL_SIZE_BOUNDS (a short list of them where LIST_SIZES allows), the
    required ones present; else one ValueError."""
    text = doc.get("text_config")
    cfg = text if isinstance(text, dict) and "num_hidden_layers" not in doc else doc
    for field, (low, high) in {**SIZE_BOUNDS, **OPTIONAL_SIZE_BOUNDS}.items():
        value = cfg.get(field)
        if field == "num_hidden_layers" and value is None:
            field, value = _layer_count(cfg)
        if value is None:
            if field in SIZE_BOUNDS:
                raise ValueError(f"{where}: the model config has no {field}")
            continue
        many = (
            field in LIST_SIZES and isinstance(value, list) and 0 < len(value) <= LIST_SIZES[field]
        )
        for v in value if many else [value]:
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                also = f" (or a list of at most {LIST_SIZES[field]})" if field in LIST_SIZES else ""
                raise ValueError(
                    f"{where}: {field} must be an integer in [{low:,}, {high:,}]{also}, "
                    f"got {value!r}"
                )


def m6_presets() -> dict:
    """The M6 example's configs, when the examples package is importable (a repository
    checkout); {} otherwise."""
    try:
        config = importlib.import_module("examples.m6.config")
    except ImportError:
        return {}
    return dict(config.CONFIGS)


DEFAULT_SEQ_LEN = 4096


def default_seq_len(name_or_path: str) -> int:
    """The sequence length a model is planned at when none is given: an M6 config's own (its
    patches + text), else DEFAULT_SEQ_LEN."""
    config = m6_presets().get(name_or_path)
    return config.seq_len if config is not None else DEFAULT_SEQ_LEN


def built_spec(doc: dict, name: str, where: str) -> ModelSpec:
    """A config.json's ModelSpec with the parameter counts of the model itself (moe.plan.built:
    a meta-device build; a multimodal model's towers counted), its sizes from the text model's
    config as transformers completes it (defaults filled in)."""
    counts = count_params(doc, where)  # transformers installed, the config builds
    text = build_config(doc).get_text_config()
    # the sizes under their usual names too (LongCat-Flash's ffn_hidden_size is
    # intermediate_size), checked as given ones are; the blocks the built model has (LongCat-
    # Flash: num_layers blocks of two layers each)
    aliases = {name: getattr(text, name, None) for name in text.attribute_map}
    fields = {**aliases, **text.to_dict(), "num_hidden_layers": len(counts.layers)}
    check_config(fields, where)
    return from_hf_config({**fields, "model_type": doc["model_type"]}, name).with_(built=counts)


def load_model(name_or_path: str) -> ModelSpec:
    """A ModelSpec from a preset name (HF_CONFIGS, or an M6 config: `m6-tiny`) or a transformers
    config.json path (untrusted: size-limited JSON). Unknown names: one error listing them."""
    if name_or_path in HF_CONFIGS:
        return built_spec(HF_CONFIGS[name_or_path], name_or_path, name_or_path)
    if name_or_path.startswith("m6-"):
        presets = m6_presets()  # named as the M6 example names them: m6-tiny, m6-1t, ...
        if name_or_path in presets:
            return from_planner_model(presets[name_or_path], name_or_path)
    check_path("model", name_or_path)
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        # Infinity: transformers writes a float("inf") default so (Nemotron-H's time_step_limit)
        doc = read_json(path, max_bytes=_MAX_CONFIG_BYTES, what="model config", infinity=True)
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: a model config must be a JSON object")
        check_config(doc, str(path))
        return built_spec(doc, path.stem if path.stem != "config" else path.parent.name, str(path))
    names = [*HF_CONFIGS, *m6_presets()]
    raise ValueError(
        f"unknown model {name_or_path!r}: a config.json path or one of {', '.join(names)}"
    )
