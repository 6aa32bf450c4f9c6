"""LoRA through the core's one hook (issue 59): MoEConfig.lora claims the weight format
(LoRAWeights) and a kernel wrapper (LoRAKernel) around whichever kernel the layer resolved. A
kernel registered from outside is used under LoRA when it declares its grouped GEMMs
(GroupedGemms), and refused with one ValueError naming it when it has `mlp` alone: never
bypassed (its mlp called 0 times while another path computes)."""

from dataclasses import dataclass

import pytest
import torch

import moe
from moe.kernels import ExpertKernel, register_kernel
from moe.kernels.registry import GroupedGemms, kernel_wrappers_for
from moe.kernels.torch_expert_mlp import expert_mlp_torch
from moe.kernels.torch_grouped_mm import grouped_mm_torch
from moe.lora import LoRAConfig, LoRAKernel, LoRAWeights, adapter_parameters, add_lora, merge

D, F, E = 6, 10, 4


@dataclass(frozen=True)
class MlpOnly(ExpertKernel):
    """A kernel from outside with the expert MLP alone (the torch op), counting its calls."""

    calls: list = None

    def mlp(self, x_ND, offsets_L, weights, *, activation, rows):
        self.calls.append("mlp")
        w = weights
        return expert_mlp_torch(
            x_ND, offsets_L, w.w1_LDF, w.w2_LFD, w.w3_LDF, w.b1_LF, w.b2_LD,
            activation=activation, rows=rows,
        )  # fmt: skip


@dataclass(frozen=True)
class WithGemms(MlpOnly, GroupedGemms):
    """The same, declaring its grouped GEMMs (torch's), counting them too."""

    def weight_mm(self, x_MK, w_EKN, offsets_E):
        self.calls.append("weight_mm")
        return grouped_mm_torch(x_MK, w_EKN, offsets_E)

    def plain_mm(self, x_MK, w_EKN, offsets_E):
        self.calls.append("plain_mm")
        return grouped_mm_torch(x_MK, w_EKN, offsets_E)


MLP_ONLY = register_kernel(MlpOnly("test_mlp_only", calls=[]))
WITH_GEMMS = register_kernel(WithGemms("test_with_gemms", calls=[]))


def _layer(backend: str, lora: bool = True) -> moe.MoELayer:
    torch.manual_seed(0)
    layer = moe.MoELayer(D, F, E, top_k=2, activation="swiglu", backend=backend)
    if lora:
        add_lora(layer, LoRAConfig(rank=2, alpha=4.0, router=True))
        with torch.no_grad():
            for name, p in adapter_parameters(layer):
                if "lora_B" in name:
                    p.normal_()
    return layer


def _run(layer: moe.MoELayer):
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = layer(x)
    y.square().sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


def test_a_kernel_with_mlp_alone_is_refused_under_lora_naming_it():
    MLP_ONLY.calls.clear()
    plain = _layer("test_mlp_only", lora=False)
    _run(plain)
    assert MLP_ONLY.calls == ["mlp"]  # used without LoRA: its mlp once per forward
    MLP_ONLY.calls.clear()
    layer = _layer("test_mlp_only")
    with pytest.raises(ValueError, match="kernel 'test_mlp_only' cannot run this layer: "
                       "MoEConfig.lora runs the adapters on the kernel's grouped GEMMs"):  # fmt: skip
        _run(layer)
    assert MLP_ONLY.calls == []  # refused before any work, never bypassed
    merge(layer)  # the adapters folded in: the kernel runs the layer again
    _run(layer)
    assert MLP_ONLY.calls == ["mlp"]


def test_a_kernel_with_grouped_gemms_is_used_under_lora():
    """Its GEMMs compute the adapted MLP: the outputs and every gradient equal the torch
    kernel's bit for bit (the same ops), and the kernel's GEMMs ran."""
    WITH_GEMMS.calls.clear()
    got = _run(_layer("test_with_gemms"))
    assert {"weight_mm", "plain_mm"} <= set(WITH_GEMMS.calls) and "mlp" not in WITH_GEMMS.calls
    want = _run(_layer("torch"))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and len(got[2]) == 8  # A, B: w1, w2, w3, router
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), name


def test_lora_is_one_setting_claiming_a_wrapper_around_the_resolved_kernel():
    layer = _layer("torch")
    assert layer.config.lora is not None and layer.config.weight_format == "dense"
    assert [w.name for w in kernel_wrappers_for(layer.config)] == ["lora"]
    kernel = layer.experts.kernel_for(torch.zeros(1))
    assert isinstance(kernel, LoRAKernel) and kernel.base.name == "torch"
    assert kernel.name == "torch" and kernel.fuses_combine == kernel.base.fuses_combine
    assert isinstance(layer.experts.weights(), LoRAWeights)
    merge(layer)
    assert not kernel_wrappers_for(layer.config)
    assert type(layer.experts.kernel_for(torch.zeros(1))).__name__ == "TorchKernel"


def test_lora_weights_slice_and_flatten_with_their_adapters():
    """ExpertWeights' tensor slots carry a subclass's adapters: tensors / with_tensors round
    trip, slice cuts the adapters with the weights (the overlapped dispatcher's parts)."""
    w = _layer("torch").experts.weights()
    flat = w.tensors()
    assert len(flat) == 5 + 6  # w1, w2, w3, b1, b2 (None) and A, B of w1, w2, w3
    back = w.with_tensors(flat)
    assert isinstance(back, LoRAWeights) and back.scale == w.scale
    assert all(back.adapters[k] is w.adapters[k] for k in w.adapters)
    part = w.slice(1, 2)
    assert part.w1_LDF.shape[0] == 2 and part.adapters["A_w2"].shape[0] == 2
    assert torch.equal(part.adapters["B_w3"], w.adapters["B_w3"][1:3])


def test_settings_and_checkpoints_that_recorded_weight_format_lora_still_load(
    tmp_path, monkeypatch
):
    """Releases before recorded weight_format="lora" beside lora=: a settings file and a
    checkpoint saved so check and load against today's LoRA layer (weight_format "dense")."""
    import json

    from moe.checkpoint import load_checkpoint, save_checkpoint, validate

    src = torch.nn.Sequential(_layer("torch"))
    moe.save_moe_settings(src, tmp_path)
    moe.check_moe_settings(src, tmp_path)  # a settings tuple (targets) reads back as saved
    path = tmp_path / "moe_config.json"
    doc = json.loads(path.read_text())
    doc["layers"][0]["config"]["weight_format"] = "lora"
    path.write_text(json.dumps(doc))
    moe.check_moe_settings(src, tmp_path)
    record = validate.moe_settings

    def old_record(model):
        return {k: {**v, "weight_format": "lora"} for k, v in record(model).items()}

    monkeypatch.setattr(validate, "moe_settings", old_record)
    save_checkpoint(str(tmp_path / "ckpt"), src)
    monkeypatch.setattr(validate, "moe_settings", record)
    dst = torch.nn.Sequential(_layer("torch"))
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    load_checkpoint(str(tmp_path / "ckpt"), dst)
    for (n, p), q in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(p, q), n
