"""The two models bench/plan_measured.py runs, built the same on every rank (bf16 weights):
the M6 example's model (examples/m6, a small preset) and a Mixtral-like tiny
transformers.MixtralForCausalLM converted by moe.from_hf; their moe.plan ModelSpec, their
sequence length, a step's batch and loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import moe
from moe.plan.spec import ModelSpec, from_hf_config, from_planner_model

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Sizes:
    """Widths of both models (the defaults: a few ms of GEMM per block on a CPU core)."""

    layers: int = 4
    d_model: int = 128
    d_ff: int = 256
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    vocab: int = 512
    seq_len: int = 64  # Mixtral; M6: 16 patches + seq_len - 16 text tokens


def m6_config(s: Sizes):
    from examples.m6.config import get_config

    return get_config("m6-tiny").replace(
        name="m6-bench", n_layers=s.layers, d_model=s.d_model, n_heads=s.heads, d_ff=s.d_ff,
        vocab_size=s.vocab, num_experts=s.experts, top_k=s.top_k, text_len=s.seq_len - 16,
        image_size=16, patch_size=4, channels=1, capacity_factor=None, aux_loss_coef=1e-2,
    )  # fmt: skip


def mixtral_config(s: Sizes):
    import transformers

    return transformers.MixtralConfig(
        vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.d_ff,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads // 2,
        max_position_embeddings=max(s.seq_len, 64), num_local_experts=s.experts,
        num_experts_per_tok=s.top_k, router_aux_loss_coef=1e-2, tie_word_embeddings=False,
    )  # fmt: skip


def spec_of(name: str, s: Sizes) -> tuple[ModelSpec, int]:
    """(the planner's ModelSpec, its sequence length) of model `name`."""
    if name == "m6":
        cfg = m6_config(s)
        return from_planner_model(cfg, name="m6"), cfg.seq_len
    return from_hf_config(mixtral_config(s).to_dict(), name="mixtral-tiny"), s.seq_len


def build(name: str, s: Sizes) -> nn.Module:
    """The model in bf16 (seeded: identical on every rank)."""
    torch.manual_seed(0)
    if name == "m6":
        from examples.m6.model import build_model

        return build_model(m6_config(s)).to(DTYPE)
    import transformers

    model = transformers.MixtralForCausalLM(mixtral_config(s))
    return moe.from_hf(model).to(DTYPE)


class Batch:
    """One rank's `rows` sequences (random tokens, fixed seed per rank)."""

    def __init__(self, name: str, s: Sizes, rows: int, rank: int):
        g = torch.Generator().manual_seed(1000 + rank)
        self.name = name
        if name == "m6":
            cfg = m6_config(s)
            self.images = torch.randn(rows, 1, 16, 16, generator=g).to(DTYPE)
            self.text = torch.randint(s.vocab, (rows, cfg.text_len), generator=g)
            self.prompt = torch.full((rows,), 2)
            self.has_image = torch.ones(rows, dtype=torch.bool)
            self.target = torch.randint(s.vocab, (rows, cfg.text_len), generator=g)
        else:
            self.text = torch.randint(s.vocab, (rows, s.seq_len), generator=g)
            self.target = torch.randint(s.vocab, (rows, s.seq_len), generator=g)

    def logits(self, model: nn.Module) -> torch.Tensor:
        if self.name == "m6":
            return model(self.images, self.text, self.prompt, self.has_image)
        return model(input_ids=self.text).logits


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())
