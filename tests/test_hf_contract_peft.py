"""LoRA -> PEFT on every family converted through the experts contract (and the table's five):
moe.lora's adapters exported by moe.interop.to_peft load in PEFT's own
peft.PeftModel.from_pretrained on the transformers model with moe's logits (float64 1e-10
relative where transformers runs in float64, float32 1e-5; the table's float32 routers 1e-5),
and read back by from_peft; a family that cannot is refused with one error (tests/hf_lora_peft.py).
The two layouts beside the plain one (gate / up interleaved, experts without a gate) are also
checked against PEFT's ParamWrapper's delta weight directly, and adapters PEFT itself trained
read back."""

import copy
import functools
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it
peft = pytest.importorskip("peft")

import moe  # noqa: E402
from moe.interop import from_peft, peft_lora_config  # noqa: E402
from moe.interop import peft_contract as C  # noqa: E402
from moe.interop import peft_layout as L  # noqa: E402
from moe.interop.hf_contract import gate_up_columns  # noqa: E402
from moe.lora import LoRAConfig, add_lora  # noqa: E402
from tests.hf_lora_peft import check_lora_peft  # noqa: E402
from tests.hf_tiny import (  # noqa: E402
    NOT_BUILT,
    contract_families,
    experts_modules,
    relative_error,
    tiny_model,
)

FAMILIES = [f for f in contract_families() if f not in NOT_BUILT]
check = functools.cache(check_lora_peft)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_exports_to_peft(family):
    r = check(family)
    if r.refusal is not None:  # one error naming why, nothing written silently wrong
        assert r.error is None and r.refusal, family
        return
    assert r.changed > 1e-3, (family, r.changed)  # the adapters move the logits
    assert r.all_loaded, family  # PEFT set every adapter from the file
    assert r.error <= r.tol, (family, r.error, r.tol)
    assert r.read_back <= r.tol, (family, r.read_back, r.tol)


def test_enough_families_export():
    passed = [f for f in FAMILIES if check(f).passed]
    assert len(passed) >= 24, passed


def _peft_wrappers(model, params):
    """PEFT's ParamWrappers on the first experts module's `params` -> {param: wrapper}, and
    PEFT's saved keys of it."""
    path = next(n for n, m in model.named_modules() if hasattr(m, "_is_expert_parallel"))
    config = peft.LoraConfig(  # to_peft's ranks: 2, gate and up together 4
        r=2, lora_alpha=3, rank_pattern={L.GATE_UP: 4}, target_modules=[],
        target_parameters=[f"{path}.{p}" for p in params],
    )  # fmt: skip
    pm = peft.get_peft_model(model, config)
    wrappers, m = {}, pm.base_model.model.get_submodule(path)
    while hasattr(m, "parameter_name"):
        wrappers[m.parameter_name], m = m, m.base_layer
    saved = set(peft.get_peft_model_state_dict(pm))
    return path, wrappers, {k.removeprefix(L.PREFIX) for k in saved}


@pytest.mark.parametrize("family", ["gpt_oss", "ergo"])  # interleaved gate/up; up_proj alone
def test_layout_is_peft_delta_weight(family):
    """export's factors for each layout give PEFT's delta weight exactly what moe.lora adds
    (float64), under the keys PEFT itself saves."""
    model = tiny_model(family, torch.float64)
    experts = experts_modules(model)[0]
    E, F = experts.num_experts, experts.down_proj.shape[1 if experts.is_transposed else 2]
    params = [p for p, _ in experts.named_parameters(recurse=False) if p in C.PROJECTIONS]
    layer = SimpleNamespace(hf_template=(experts,), config=SimpleNamespace(d_ff=F))
    d = model.config.get_text_config().hidden_size
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (d, F), "w3": (d, F), "w2": (F, d)}
    targets = [t for p in params for t in C.PROJECTIONS[p]]
    factors = {
        t: (torch.randn(E, shapes[t][0], 2, generator=g, dtype=torch.float64),
            torch.randn(E, 2, shapes[t][1], generator=g, dtype=torch.float64))
        for t in targets
    }  # fmt: skip
    path, wrappers, saved = _peft_wrappers(model, params)
    exported = C.export(path, layer, factors)
    assert {k.removeprefix(L.PREFIX) for v in exported.values() for k in v} == saved
    for p, wrapper in wrappers.items():
        (ka, a), (kb, b) = exported[f"{path}.{p}"].items()
        with torch.no_grad():
            wrapper.lora_A["default"].weight.copy_(a)
            wrapper.lora_B["default"].weight.copy_(b)
        wrapper.scaling["default"] = 1.0
        got = wrapper.get_delta_weight("default")  # the parameter's own orientation
        want = {t: torch.bmm(*factors[t]) for t in C.PROJECTIONS[p]}  # [E, in, out]
        if p == L.GATE_UP:  # in the columns the conversion reads gate and up from
            gate, up = gate_up_columns(experts, F)
            cols = torch.zeros(E, d, 2 * F, dtype=torch.float64)
            cols[..., gate], cols[..., up] = want["w1"], want["w3"]
            want = cols
        else:
            (want,) = want.values()
        want = want if experts.is_transposed else want.transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family, params", [("glm4_moe", ("gate_up_proj", "down_proj")),
                                            ("aria", ("down_proj",))])  # fmt: skip
def test_peft_trained_adapter_reads_back(family, params, tmp_path):
    """An adapter PEFT itself made (random A and B, its own keys) on a contract family reads
    into the converted model with the PeftModel's logits; Aria's experts are transposed."""
    reference = tiny_model(family, torch.float64)
    paths = [n for n, m in reference.named_modules() if hasattr(m, "_is_expert_parallel")]
    config = peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=[], init_lora_weights=False,
        target_parameters=[f"{path}.{p}" for path in paths for p in params],
    )  # fmt: skip
    pm = peft.get_peft_model(copy.deepcopy(reference), config).eval()
    pm.save_pretrained(tmp_path)
    model = moe.from_hf(copy.deepcopy(reference))
    add_lora(model, LoRAConfig(**peft_lora_config(str(tmp_path))))
    from_peft(model, str(tmp_path))
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want, got = pm(input_ids=ids).logits, model.eval()(input_ids=ids).logits
        plain = reference.eval()(input_ids=ids).logits
    assert relative_error(want, plain) > 1e-3  # the adapter changes the function
    assert relative_error(got, want) <= 1e-10, family
