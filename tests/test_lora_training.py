"""LoRA on the experts (issue 50) in training: moe.memory.estimate_memory counts the adapters as
the trainable parameters, GroupedApply (and its CPU offload) trains them as AdamW does, whole
and adapters-only checkpoints load exactly, and docs/lora.md's snippet runs."""

import pytest
import torch

import moe
from moe.lora import LoRAConfig, adapter_parameters, add_lora
from tests.test_lora import F_, D, E, R, build


class _Planned:
    """A PlannerModel (moe.memory) whose build() is two LoRA'd MoE layers (or plain ones)."""

    n_layers, d_model, n_heads, d_ff, vocab_size, seq_len = 2, 16, 2, 24, 8, 4
    num_experts, top_k, capacity_factor, activation = 4, 2, None, "swiglu"

    def __init__(self, lora: LoRAConfig | None):
        self.lora = lora

    def build(self):
        model = torch.nn.Sequential(
            *[moe.MoELayer(16, 24, 4, top_k=2, activation="swiglu") for _ in range(2)]
        )
        return model if self.lora is None else add_lora(model, self.lora)


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_plan_memory_counts_adapters_as_trainable(layout):
    from moe.memory import estimate_memory

    kw = {"world_size": 2, "dp": 1, "ep": 2, "data_parallel": layout, "dtype": torch.float32}
    plain = estimate_memory(_Planned(None), **kw)
    lora = estimate_memory(_Planned(LoRAConfig(rank=2, alpha=2.0)), **kw)
    adapters = 2 * 4 * 3 * (16 * 2 + 2 * 24)  # layers x experts x (w1, w2, w3) x (A + B)
    assert lora.trainable_params == adapters and plain.trainable_params == plain.total_params
    assert lora.total_params == plain.total_params + adapters
    assert lora.gradients < plain.gradients / 2 and lora.optimizer_state < plain.optimizer_state / 2
    assert lora.parameters >= plain.parameters  # frozen weights are still held
    assert "trainable, rest frozen" in str(lora)
    if layout == "ddp":  # ep=2 halves the experts' adapters; the routers are frozen too
        assert lora.gradients == 4 * (adapters // 2)
        assert lora.optimizer_state == 2 * lora.gradients


@pytest.mark.parametrize("offload", [None, "all"])
def test_grouped_apply_and_offload_train_the_adapters_as_adamw(offload):
    from moe.memory import GroupedApply

    models = [build(dtype=torch.float32, lora=LoRAConfig(rank=2, alpha=2.0)) for _ in range(2)]
    named = [n for n, _ in adapter_parameters(models[0])]
    opts = [
        GroupedApply(adapter_parameters(models[0]), torch.optim.AdamW, 3, offload, lr=1e-2),
        torch.optim.AdamW([p for _, p in adapter_parameters(models[1])], lr=1e-2),
    ]
    base = {n: p.clone() for n, p in models[0].named_parameters() if not p.requires_grad}
    x = torch.randn(3, 9, D, generator=torch.Generator().manual_seed(2))
    for step in range(3):
        for model, opt in zip(models, opts):
            model(x[step]).square().sum().backward()
            opt.step()
            opt.zero_grad()
    a, b = dict(models[0].named_parameters()), dict(models[1].named_parameters())
    tol = {"rtol": 0, "atol": 1e-7} if offload is None else {"rtol": 1e-5, "atol": 1e-6}
    for n in named:
        assert not torch.equal(a[n], a[n].new_zeros(a[n].shape))
        torch.testing.assert_close(a[n], b[n], **tol, msg=n)
    assert all(torch.equal(a[n], base[n]) for n in base)  # the frozen base never moves


def test_docs_lora_md_snippets_run():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "lora.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/lora.md", "exec"), {})


def test_checkpoints_of_a_lora_model(tmp_path):
    """Whole and adapters-only checkpoints load exactly; the settings are checked: a LoRA
    checkpoint into a model of another rank (or without adapters) is refused, unchanged."""
    from moe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    def model(seed, rank=R):
        return build(seed=seed, lora=LoRAConfig(rank=rank, alpha=2.0))

    src = model(0)
    x = torch.randn(6, D, dtype=torch.float64)
    for only in (False, True):
        save_checkpoint(str(tmp_path / str(only)), src, trainable_only=only)
        dst = model(1)  # another base: an adapters-only load says so unless allowed
        load_checkpoint(str(tmp_path / str(only)), dst, allow_config_change=only)
        for n, p in src.named_parameters():  # the base comes along only in the whole one
            assert torch.equal(dict(dst.named_parameters())[n], p) == (only is False or "lora" in n)
        assert torch.equal(dst(x), src(x)) == (not only)
    for other in (model(2, rank=2), moe.MoELayer(D, F_, E, top_k=2, activation="swiglu")):
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(CheckpointError, match="lora"):
            load_checkpoint(str(tmp_path / "True"), other)
        assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    with pytest.raises(ValueError, match="trainable_only must be a bool"):
        save_checkpoint(str(tmp_path / "x"), src, trainable_only="yes")
