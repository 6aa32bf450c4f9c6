"""The planner's parameter counts are the model's own (moe.plan.built: a meta-device build of
the config): equal to num_parameters() of the real model for families on transformers' experts
contract, multimodal ones with their vision towers; an unknown model type is one error."""

import json
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
# multimodal (Qwen3-VL-MoE, Aria, GLM-4.5V, ...). Not yet counted: the planner's reading of
# their tiny config.json fails (a config that does not rebuild from its own to_dict, list-valued
# sizes, non-finite values, num_layers) or differs (minimax_m3_vl, unlimited_ocr): open work.
NOT_COUNTED = {
    "dots3_note", "ernie4_5_vl_moe", "glm5_next", "laguna", "lara_mini", "longcat_flash",
    "minimax_m3_vl", "mistral_large4", "muse_spark", "nemotron_h", "unlimited_ocr", "zaya",
}  # fmt: skip
FAMILIES = [f for f, row in support().items() if "moe" in row and f not in NOT_COUNTED]


def config_file(model, tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model.config.to_dict()))
    return str(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_counts_equal_the_model(family, tmp_path):
    model = tiny_model(family)
    spec = load_model(config_file(model, tmp_path))
    assert spec.total_params() == model.num_parameters()
    routed = sum(
        p.numel()
        for m in model.modules()
        if hasattr(m, "_is_expert_parallel")
        for p in m.parameters()
    )
    assert sum(spec.layer_params(i)[1] for i in range(spec.n_layers)) == routed
    k, E = spec.top_k, spec.num_experts
    assert spec.active_params() == model.num_parameters() - routed + routed * k // E


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
