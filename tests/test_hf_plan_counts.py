"""The planner's parameter counts are the model's own (moe.plan.built: a meta-device build of
the config): equal to num_parameters() of the real model for families on transformers' experts
contract, multimodal ones with their vision towers, read from a config.json file as the CLI
reads it; a config it cannot count (an unknown model type, one transformers' own validation
refuses, a size out of bounds) is one error, exit status 2."""

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from moe.plan.models import load_model  # noqa: E402
from tests.hf_matrix import support  # noqa: E402
from tests.hf_tiny import tiny_model  # noqa: E402

# every family of the support table's matrix (tests/data/hf_support.json) built by
# tests/hf_tiny.py: dense layers mixed in (DeepSeek-V3, GLM-4.5), shared experts (Qwen2-MoE),
# expert biases and interleaved gate/up (GPT-OSS), a non-gated transposed expert (Ergo),
# multimodal (Qwen3-VL-MoE, Aria, GLM-4.5V, ...), list-valued expert widths (ERNIE-4.5-VL),
# num_layers blocks of two layers (LongCat-Flash), an Infinity in the config (Nemotron-H).
FAMILIES = [f for f, row in support().items() if "moe" in row]

# The shrinker (tests/hf_tiny.py) sets num_hidden_layers after the config's validation, not the
# per-layer fields that must match it: cut to the layers kept (a list: its first entries, a
# dict keyed by layer index: those keys), so the config.json rebuilds as a user's file does.
PER_LAYER = {
    "dots3_note": [("text_config", "per_layer_config"), ("vision_config", "per_layer_config")],
    "laguna": [(None, "num_attention_heads_per_layer")],
    "lara_mini": [(None, "layer_types")],
    "mistral_large4": [("text_config", "kv_source_layers"), ("text_config", "no_rope_layers")],
    "muse_spark": [("text_config", "layer_rope_theta"), ("audio_config", "patch_sizes"),
                   ("audio_config", "hidden_sizes"), ("audio_config", "depths")],
}  # fmt: skip
# sizes the shrinker sets that the config's validation refuses: (sub-config, key) -> value
VALID = {
    "zaya": {(None, "num_experts_per_tok"): 1},  # ZAYA takes top-1 routing only
    "dots3_note": {  # SWA head_dim = qk nope + rope dims; the vision adapter's input its width
        ("text_config", "head_dim"): 16,
        ("vision_config", "adapter_in_dim"): 32,
        ("audio_config", "adapter_input_size"): 32,
        ("vision_config", "adapter_out_dim"): 32,
        ("audio_config", "adapter_out_dim"): 32,
    },
}


def user_file(family: str, model, tmp_path) -> str:
    """The tiny model's config.json, as a user's file: valid for its own config class, naming
    the model's class as save_pretrained does."""
    doc = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    for sub, key in PER_LAYER.get(family, []):
        cfg = doc[sub] if sub else doc
        n, value = cfg["num_hidden_layers"], cfg[key]
        cut = (
            value[:n] if isinstance(value, list) else {k: v for k, v in value.items() if int(k) < n}
        )
        cfg[key] = cut
    for (sub, key), value in VALID.get(family, {}).items():
        (doc[sub] if sub else doc)[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return str(path)


def user_model(family: str, tmp_path):
    """(config.json path, the model transformers builds from that file): the reference is the
    file's model (a shrunk config's derived size, e.g. MiniMax-M3-VL's merged_hidden_size, is
    recomputed from the file, as for any user's config.json)."""
    from transformers import AutoConfig

    tiny = tiny_model(family)
    path = user_file(family, tiny, tmp_path)
    return path, type(tiny)(AutoConfig.from_pretrained(tmp_path))


def config_file(model, tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model.config.to_dict()))
    return str(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_counts_equal_the_model(family, tmp_path):
    path, model = user_model(family, tmp_path)
    spec = load_model(path)
    assert spec.total_params() == model.num_parameters()
    routed = sum(  # the text decoder's experts (Dots3-Note's vision experts count as its tower)
        p.numel()
        for m in model.get_decoder().modules()
        if hasattr(m, "_is_expert_parallel")
        for p in m.parameters()
    )
    assert sum(spec.layer_params(i)[1] for i in range(spec.n_layers)) == routed
    k, E = spec.top_k, spec.num_experts
    assert spec.active_params() == model.num_parameters() - routed + routed * k // E
    # without architectures (a hand-written file): the auto class, else the family's only
    # causal-LM class; a model that is neither is refused, never counted without its head
    doc = json.loads((tmp_path / "config.json").read_text())
    del doc["architectures"]
    (tmp_path / "bare").mkdir()
    bare = tmp_path / "bare" / "config.json"
    bare.write_text(json.dumps(doc))
    try:
        assert load_model(str(bare)).total_params() == model.num_parameters()
    except ValueError as e:
        assert "name the model's class in the config's architectures" in str(e)


def test_cli_prints_the_exact_count(tmp_path):
    model = tiny_model("qwen3_vl_moe")
    path = config_file(model, tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "moe.plan", "--model", path, "--tokens", "65536", "--top", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert f"({model.num_parameters():,} = " in out.stdout


def test_unknown_model_type_is_one_error(tmp_path):
    doc = {**tiny_model("mixtral").config.to_dict(), "model_type": "no_such_family"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="no_such_family.*cannot be counted"):
        load_model(str(path))


@pytest.mark.parametrize(
    "family, change, message",
    [  # the tiny config as the shrinker leaves it: 40 heads listed for 2 layers
        ("laguna", {}, "cannot build this laguna config.*num_attention_heads_per_layer"),
        ("nemotron_h", {"time_step_limit": [0.0, float("nan")]}, r"time_step_limit\[1\] is NaN"),
        ("ernie4_5_vl_moe", {"moe_intermediate_size": [16] * 9}, "or a list of at most 8"),
        ("ernie4_5_vl_moe", {"moe_intermediate_size": [16, 0]}, r"in \[1, 1,048,576\]"),
        ("longcat_flash", {"num_layers": 2000}, r"num_layers must be an integer in \[1, 1,024\]"),
        ("longcat_flash", {"ffn_hidden_size": 1 << 21}, "intermediate_size must be an integer"),
        ("nemotron_h", {"layers_block_type": ["moe"] * 1025}, r"len\(layers_block_type\) must"),
        # a token classifier: no causal-LM class to build without the file naming its class
        ("openai_privacy_filter", {}, "name the model's class in the config's architectures"),
    ],
)
def test_a_config_it_cannot_count_is_one_error_exit_2(family, change, message, tmp_path, capsys):
    """Through the CLI: transformers' own validation, NaN (Infinity is read: Nemotron-H's
    default), list-valued and aliased sizes out of bounds: one line, exit status 2."""
    from moe.plan import cli

    doc = tiny_model(family).config.to_dict()
    (doc.get("text_config") or doc).update(change)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as done:
        cli.main(["--model", str(path), "--tokens", "4K"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err.strip().splitlines()[-1]), err
