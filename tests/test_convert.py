"""swap_ffn: detection, upcycling equivalence, refusals, state_dict round trip."""

import io

import pytest
import torch
from torch import nn

import moe


class GPT2MLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.c_fc, self.c_proj, self.act = nn.Linear(d, f), nn.Linear(f, d), nn.GELU("tanh")

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class LlamaMLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, d, mlp):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = mlp

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def tiny_transformer(d=16, f=40):
    torch.manual_seed(0)
    return nn.Sequential(
        Block(d, nn.Sequential(nn.Linear(d, f), nn.ReLU(), nn.Linear(f, d))),
        Block(d, GPT2MLP(d, f)),
        Block(d, LlamaMLP(d, f)),
        nn.Linear(d, 3),
    )


@pytest.mark.parametrize("top_k,router", [(2, "topk"), (1, "switch"), (2, "prototype")])
def test_upcycled_model_computes_the_dense_function(top_k, router):
    model = tiny_transformer()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        dense_y = model(x)
    moe.swap_ffn(model, num_experts=4, top_k=top_k, router=router, upcycle=True)
    layers = moe.moe_layers(model)
    assert [n for n, _ in layers] == ["0.mlp", "1.mlp", "2.mlp"]
    assert [m.config.activation for _, m in layers] == ["relu", "gelu_tanh", "swiglu"]
    assert layers[0][1].config.bias and not layers[2][1].config.bias
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense_y, rtol=1e-5, atol=1e-5)
    model.train()
    model(x).sum().backward()  # the converted model trains
    assert layers[1][1].experts.w1.grad is not None


def test_predicate_selects_and_refuses():
    model = tiny_transformer()
    moe.swap_ffn(model, num_experts=2, top_k=1, predicate=lambda n, m: n == "1.mlp")
    assert [n for n, _ in moe.moe_layers(model)] == ["1.mlp"]
    with pytest.raises(moe.ConversionError, match="0.attn: cannot convert MultiheadAttention"):
        moe.swap_ffn(tiny_transformer(), predicate=lambda n, m: n == "0.attn")
    with pytest.raises(moe.ConversionError, match="no dense FFN"):
        moe.swap_ffn(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="top_k=9 exceeds"):
        moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=9)


def test_state_dict_round_trip_is_exact_and_safe():
    model = moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=2)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # no arbitrary unpickling
    assert any(k.endswith("router.expert_bias") for k in state)
    fresh = moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=2)
    for p in fresh.parameters():
        nn.init.normal_(p)
    fresh.load_state_dict(state)
    x = torch.randn(3, 5, 16)
    model.eval(), fresh.eval()
    assert torch.equal(model(x), fresh(x))


def test_public_api_is_reachable_from_import_moe():
    """DESIGN.md's public names work after a plain `import moe` (a subprocess: fresh imports)."""
    import subprocess
    import sys

    names = ["moe.MoELayer", "moe.aux_loss", "moe.swap_ffn", "moe.parallel.init_mesh",
             "moe.parallel.parallelize", "moe.parallel.GroupedApply", "moe.parallel.plan",
             "moe.parallel.save_checkpoint", "moe.parallel.load_checkpoint",
             "moe.dispatch.all_to_all"]  # fmt: skip
    code = "import moe\n" + "\n".join(f"assert callable({n}), '{n}'" for n in names)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_settings_with_two_entries_for_one_module_are_refused_by_every_reader(tmp_path):
    """swap_ffn_from_settings used to apply the last of two conflicting entries, while
    check_moe_settings rejected the file."""
    import json

    model = moe.swap_ffn(tiny_transformer(), num_experts=4, top_k=2)
    path = moe.save_moe_settings(model, tmp_path)
    doc = json.loads(path.read_text())
    twin = json.loads(json.dumps(doc["layers"][1]))
    twin["config"]["top_k"] = 1
    doc["layers"].append(twin)
    path.write_text(json.dumps(doc))
    match = r"layers\[1\] and layers\[3\] both describe the module '1.mlp'"
    dense = tiny_transformer()
    with pytest.raises(ValueError, match=match):
        moe.swap_ffn_from_settings(dense, tmp_path)
    assert not moe.moe_layers(dense)  # nothing changed
    with pytest.raises(ValueError, match=match):
        moe.check_moe_settings(model, tmp_path)
    path.write_text('{"format": "moe.swap_ffn", "version": 1, "layers": ' + "[" * 200 + "]" * 201)
    with pytest.raises(ValueError, match="moe_config.json.: JSON nested 201 levels deep"):
        moe.swap_ffn_from_settings(tiny_transformer(), tmp_path)
