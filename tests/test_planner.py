"""Memory estimate: meta-device parameter counts, activation formula against saved tensors,
and the M6 1T configuration on 480 x 32 GB."""

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe
from moe.memory import estimate_memory
from moe.memory.activations import activation_bytes
from moe.memory.estimate import GiB
from moe.memory.model_counts import PlannerModel, count_parameters


class Attention(nn.Module):
    """Plain softmax attention (its saved tensors are what the planner's formula counts)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        scores_BHSS = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.n_heads)
        mask_SS = torch.ones(S, S, dtype=torch.bool, device=x_BSD.device).tril()
        probs_BHSS = scores_BHSS.masked_fill(~mask_SS, float("-inf")).softmax(-1)
        return self.out((probs_BHSS @ v).transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, cfg: "TinyConfig", moe_ffn: bool):
        super().__init__()
        d = cfg.d_model
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, cfg.n_heads)
        if moe_ffn:
            self.ffn = moe.MoELayer(
                d,
                cfg.d_ff,
                cfg.num_experts,
                top_k=cfg.top_k,
                capacity_factor=cfg.capacity_factor,
                router=cfg.router,
            )
        else:
            self.ffn = nn.Sequential(nn.Linear(d, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, d))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.attn(self.ln1(x_BSD))
        return x_BSD + self.ffn(self.ln2(x_BSD))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: "TinyConfig"):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, cfg.num_experts > 0 and (i + 1) % cfg.moe_every == 0)
            for i in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_BSD = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.head(self.ln_f(x_BSD))


@dataclass(frozen=True)
class TinyConfig:
    """The planner's duck-typed model-config protocol, for a small MoE transformer."""

    n_layers: int = 2
    d_model: int = 32
    n_heads: int = 4
    d_ff: int = 64
    vocab_size: int = 50
    seq_len: int = 16
    num_experts: int = 4
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float | None = None
    router: str = "topk"

    def build(self) -> nn.Module:
        return TinyTransformer(self)


def loss_of(model: nn.Module, tokens_BS: torch.Tensor) -> torch.Tensor:
    logits = model(tokens_BS)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens_BS.flatten()) + moe.aux_loss(model)


def test_model_configs_satisfy_the_planner_interface():
    from examples.m6.config import CONFIGS

    assert isinstance(TinyConfig(), PlannerModel)
    for cfg in CONFIGS.values():
        assert isinstance(cfg, PlannerModel), cfg.name
    assert not isinstance(object(), PlannerModel)


def test_counts_equal_meta_model():
    cfg = TinyConfig(n_layers=3, moe_every=2, num_experts=8)
    counts = count_parameters(cfg)
    real = cfg.build()
    assert counts.total == sum(p.numel() for p in real.parameters())
    expert = sum(p.numel() for _, p in moe.parallel.expert_parameters(real))
    assert counts.expert == expert and counts.dense == counts.total - expert
    p = estimate_memory(cfg, world_size=8, dp=2, ep=4, dtype=torch.float32)
    assert p.total_params == counts.total
    assert p.local_params == counts.dense + expert // 4
    assert p.parameters == p.local_params * 4 and p.gradients == p.parameters
    # AdamW: two fp32 states, no masters for fp32; offload moves them to the host.
    assert p.optimizer_state == 8 * p.local_params
    off = estimate_memory(cfg, world_size=8, dp=2, ep=4, dtype=torch.float32, offload="all")
    assert off.optimizer_state == 0 and off.host_bytes > 0 and off.step_temporaries == 0
    bf16 = estimate_memory(cfg, world_size=8, dp=2, ep=4, dtype=torch.bfloat16, offload="optimizer")
    assert bf16.optimizer_state == 4 * bf16.local_params  # device fp32 masters only


def test_groups_and_checkpointing_reduce_memory():
    cfg = TinyConfig()
    base = estimate_memory(cfg, world_size=1, dp=1, ep=1, groups=1)
    four = estimate_memory(cfg, world_size=1, dp=1, ep=1, groups=4)
    assert four.step_temporaries == pytest.approx(base.step_temporaries / 4, rel=0.01)
    ckpt = estimate_memory(cfg, world_size=1, dp=1, ep=1, checkpointing=True, micro_batch_tokens=64)
    full = estimate_memory(cfg, world_size=1, dp=1, ep=1, micro_batch_tokens=64)
    assert ckpt.activations < full.activations
    assert (
        "fits" in str(base)
        and base.fits
        and base.headroom == base.device_memory_bytes - (base.total)
    )


def test_plan_validates():
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(TinyConfig(), world_size=8, dp=3, ep=2)
    with pytest.raises(ValueError, match="num_experts"):
        estimate_memory(TinyConfig(num_experts=4), world_size=8, dp=1, ep=8)
    with pytest.raises(ValueError, match="offload"):
        estimate_memory(TinyConfig(), world_size=1, dp=1, ep=1, offload="gpu")
    with pytest.raises(TypeError, match="is not a moe.memory.PlannerModel: it has no n_layers"):
        estimate_memory(object(), world_size=1, dp=1, ep=1)  # e.g. a transformers LlamaConfig


def measured_activation_bytes(model: nn.Module, tokens_BS: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, tokens_BS)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("moe_every", [1, 2])
def test_activation_estimate_tracks_saved_tensors(moe_every):
    """On CPU the saved-tensor bytes stand in for CUDA peak memory (no GPU in this run)."""
    cfg = TinyConfig(n_layers=2, d_model=64, n_heads=4, d_ff=128, seq_len=32, vocab_size=64)
    cfg = TinyConfig(**{**cfg.__dict__, "moe_every": moe_every})
    torch.manual_seed(0)
    model = cfg.build()
    tokens_BS = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    measured = measured_activation_bytes(model, tokens_BS)
    estimate = activation_bytes(cfg, tokens_BS.numel(), act_bytes=4, fused_experts=True)
    assert abs(estimate - measured) / measured < 0.2, (estimate, measured)


def test_m6_1t_fits_on_480_v100():
    m6 = pytest.importorskip("examples.m6.config")
    cfg = m6.get_config("m6-1t")
    kw = dict(world_size=480, dp=1, ep=480, dtype=torch.float16, groups=4)
    kw["micro_batch_tokens"] = 8 * cfg.seq_len
    without = estimate_memory(cfg, **kw)
    with_offload = estimate_memory(cfg, **kw, offload="all")
    assert without.total_params > 1e12 and not without.fits
    assert with_offload.fits and with_offload.headroom > 4 * GiB


def test_fsdp_layout_shards_parameters_gradients_and_optimizer_state():
    cfg = TinyConfig(n_layers=4, moe_every=2, num_experts=8)
    counts = count_parameters(cfg)
    ddp = estimate_memory(cfg, world_size=8, dp=4, ep=2, dtype=torch.float32)
    fsdp = estimate_memory(cfg, world_size=8, dp=4, ep=2, dtype=torch.float32, data_parallel="fsdp")
    assert "layout fsdp" in str(fsdp) and "layout ddp" in str(ddp)
    assert ddp.local_params == counts.dense + counts.expert // 2
    assert fsdp.local_params == -(-counts.total // 8)  # every parameter over all devices
    unit = max(-(-counts.dense // 4), -(-counts.expert // (2 * 2)))  # a block / a layer's experts
    assert fsdp.parameters == (fsdp.local_params + 2 * unit) * 4
    assert fsdp.gradients == (fsdp.local_params + unit) * 4
    assert fsdp.optimizer_state == fsdp.local_params * 2 * 4
    assert fsdp.optimizer_state < ddp.optimizer_state
    with pytest.raises(ValueError, match="data_parallel='zero3'"):
        estimate_memory(cfg, world_size=8, dp=4, ep=2, data_parallel="zero3")


def test_the_names_before_the_rename_are_kept_one_release():
    """plan_memory / MemoryPlan: the public names before "plan" meant the layout planner."""
    assert moe.memory.plan_memory is estimate_memory
    assert moe.memory.MemoryPlan is moe.memory.MemoryEstimate
