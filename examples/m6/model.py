"""M6-style model: image patches and text in one transformer with a prefix-LM mask.

The model is written dense (plain Linear-GELU-Linear FFNs) and `build_model` turns the FFNs
of the MoE blocks into MoELayers with moe.swap_ffn: model code stays free of MoE details.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

import moe

if TYPE_CHECKING:
    from examples.m6.config import M6Config

_ACTIVATION_MODULES = {"gelu": nn.GELU, "relu": nn.ReLU}


def prefix_lm_mask(
    n_patches: int, text_len: int, prompt_len_B: torch.Tensor, has_image_B: torch.Tensor
) -> torch.Tensor:
    """allowed_BSS[b, i, j]: may position i attend to position j.

    Bidirectional over the prefix (image patches + prompt), causal over the text after it.
    Samples without an image hide the patch positions from every query. Every row keeps at
    least one allowed key (itself or the prompt), so softmax never sees an all-masked row.
    """
    S = n_patches + text_len
    pos_S = torch.arange(S, device=prompt_len_B.device)
    causal_SS = pos_S[None, :] <= pos_S[:, None]
    prefix_BS = pos_S[None, :] < (n_patches + prompt_len_B)[:, None]
    hidden_BS = (pos_S[None, :] < n_patches) & ~has_image_B[:, None]
    return (causal_SS[None] | prefix_BS[:, None, :]) & ~hidden_BS[:, None, :]


class PatchEmbed(nn.Module):
    """[B, C, H, W] images -> [B, P, D]: non-overlapping patches, one Linear (as in ViT)."""

    def __init__(self, channels: int, patch_size: int, d_model: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Linear(channels * patch_size**2, d_model)

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        patches_BPX = rearrange(images_BCHW, "b c (h p) (w q) -> b (h w) (c p q)", p=p, q=p)
        return self.proj(patches_BPX)


class Attention(nn.Module):
    """Multi-head self-attention with a boolean mask (True = may attend)."""

    def __init__(self, d_model: int, n_heads: int, bias: bool):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x_BSD: torch.Tensor, allowed_BSS: torch.Tensor) -> torch.Tensor:
        qkv = rearrange(
            self.qkv(x_BSD), "b s (three h e) -> three b h s e", three=3, h=self.n_heads
        )
        y_BHSE = F.scaled_dot_product_attention(
            qkv[0], qkv[1], qkv[2], attn_mask=allowed_BSS[:, None]
        )
        return self.out(rearrange(y_BHSE, "b h s e -> b s (h e)"))


class Block(nn.Module):
    """Pre-LN transformer block; `ffn` is a dense Sequential until swap_ffn replaces it."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, activation: str, bias: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads, bias)
        self.ffn = nn.Sequential(
            nn.Linear(d_model, d_ff, bias=bias),
            _ACTIVATION_MODULES[activation](),
            nn.Linear(d_ff, d_model, bias=bias),
        )

    def forward(self, x_BSD: torch.Tensor, allowed_BSS: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.attn(self.ln1(x_BSD), allowed_BSS)
        return x_BSD + self.ffn(self.ln2(x_BSD))


class M6Model(nn.Module):
    """[image patches; text] -> next-token logits over the text positions.

    Text layout per sample: prompt tokens, <bos>, target tokens, <eos>, padding. The prefix
    (patches + prompt) is attended bidirectionally; <bos> and the target causally.
    """

    def __init__(self, cfg: M6Config):
        super().__init__()
        d = cfg.d_model
        self.n_patches, self.text_len = cfg.n_patches, cfg.text_len
        self.patch_embed = PatchEmbed(cfg.channels, cfg.patch_size, d)
        self.tok_embed = nn.Embedding(cfg.vocab_size, d)
        self.pos_embed = nn.Parameter(torch.empty(cfg.seq_len, d))
        self.type_embed = nn.Embedding(2, d)  # 0: image patch, 1: text token
        self.blocks = nn.ModuleList(
            Block(d, cfg.n_heads, cfg.ffn_width(i), cfg.activation, cfg.bias)
            for i in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.checkpointing = False  # recompute each block in backward (saves activations)
        for t in (self.pos_embed, self.tok_embed.weight, self.type_embed.weight):
            nn.init.normal_(t, std=0.02)

    def forward(
        self,
        images_BCHW: torch.Tensor,
        text_BL: torch.Tensor,
        prompt_len_B: torch.Tensor,
        has_image_B: torch.Tensor,
    ) -> torch.Tensor:
        patches_BPD = self.patch_embed(images_BCHW) + self.type_embed.weight[0]
        tokens_BLD = self.tok_embed(text_BL) + self.type_embed.weight[1]
        x_BSD = torch.cat([patches_BPD, tokens_BLD], dim=1) + self.pos_embed
        allowed_BSS = prefix_lm_mask(self.n_patches, self.text_len, prompt_len_B, has_image_B)
        for block in self.blocks:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                x_BSD = checkpoint(block, x_BSD, allowed_BSS, use_reentrant=False)
            else:
                x_BSD = block(x_BSD, allowed_BSS)
        h_BLD = self.ln_f(x_BSD[:, self.n_patches :])
        return h_BLD @ self.tok_embed.weight.t()  # output head tied to the embedding


def build_model(cfg: M6Config, verbose: bool = False) -> nn.Module:
    """The dense M6Model, then moe.swap_ffn on the FFNs of the MoE blocks (in place)."""
    model = M6Model(cfg)
    names = set(cfg.moe_block_names())
    if names:
        moe.swap_ffn(
            model,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            predicate=lambda name, module: name in names,
            verbose=verbose,
            **cfg.moe_options(),
        )
    return model


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, expert) parameter counts; works on meta-device models (no memory)."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        p.numel() for _, layer in moe.moe_layers(model) for p in layer.experts.parameters()
    )
    return total, experts
