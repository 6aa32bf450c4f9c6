"""The M6 model as an nn.Sequential for pipeline stages (--pp): embedding, blocks, head, each
passing one tensor, sharing the single-process model's modules (no copy, the same weights).

    inputs [B, C*H*W + L + 2]   image pixels, text token ids, prompt length, has-image flag
    embed  -> [B, S, D + 2]     the hidden states, with the two mask numbers as 2 channels
    blocks_i -> [B, S, D + 2]   each block rebuilds the prefix-LM mask from those 2 channels
    head   -> [B, L, V]         final LayerNorm, the output head tied to the token embedding

Every value of the packed tensors is exact in float32 (token ids < 2**24). The head holds
its own copy of the token embedding (`head.weight`): the first and last stages live on
different ranks, so the tie is kept by summing the two copies' gradients after each step
(examples/m6/pipe.py), as Megatron-LM does. `single_names` maps each stage tensor's name to
the single-process M6Model's (`blocks_1.ffn.router.weight` -> `blocks.1.ffn.router.weight`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from examples.m6.data import Batch
from examples.m6.model import Block, M6Model, prefix_lm_mask

TIED = "head.weight"  # the head's copy of tok_embed.weight


def pack_inputs(batch: Batch) -> torch.Tensor:
    """A batch as one float32 tensor [B, C*H*W + L + 2] (the first stage's input)."""
    B = batch.text_BL.shape[0]
    return torch.cat(
        [
            batch.images_BCHW.reshape(B, -1).float(),
            batch.text_BL.float(),
            batch.prompt_len_B[:, None].float(),
            batch.has_image_B[:, None].float(),
        ],
        dim=1,
    )


def _mask(meta_BS2: torch.Tensor, n_patches: int, text_len: int) -> torch.Tensor:
    meta_B2 = meta_BS2[:, 0]
    return prefix_lm_mask(n_patches, text_len, meta_B2[:, 0].long(), meta_B2[:, 1] > 0.5)


class M6Embed(nn.Module):
    """Patch and token embeddings, positions and types: the first stage's child."""

    def __init__(self, model: M6Model, image_shape: tuple[int, int, int]):
        super().__init__()
        self.patch_embed, self.tok_embed = model.patch_embed, model.tok_embed
        self.pos_embed, self.type_embed = model.pos_embed, model.type_embed
        self.image_shape, self.text_len = image_shape, model.text_len

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        B, pixels = packed.shape[0], torch.Size(self.image_shape).numel()
        images_BCHW = packed[:, :pixels].reshape(B, *self.image_shape)
        text_BL = packed[:, pixels : pixels + self.text_len].long()
        meta_B2 = packed[:, pixels + self.text_len :]
        patches_BPD = self.patch_embed(images_BCHW) + self.type_embed.weight[0]
        tokens_BLD = self.tok_embed(text_BL) + self.type_embed.weight[1]
        x_BSD = torch.cat([patches_BPD, tokens_BLD], dim=1) + self.pos_embed
        meta_BS2 = meta_B2[:, None].expand(B, x_BSD.shape[1], 2).to(x_BSD.dtype)
        return torch.cat([x_BSD, meta_BS2], dim=-1)


class M6PipeBlock(nn.Module):
    """A Block's own children (same names) run on the packed hidden states."""

    def __init__(self, block: Block, n_patches: int, text_len: int):
        super().__init__()
        self.ln1, self.ln2, self.attn, self.ffn = block.ln1, block.ln2, block.attn, block.ffn
        self.n_patches, self.text_len = n_patches, text_len

    def forward(self, packed_BSX: torch.Tensor) -> torch.Tensor:
        x_BSD, meta_BS2 = packed_BSX[..., :-2], packed_BSX[..., -2:].detach()
        allowed_BSS = _mask(meta_BS2, self.n_patches, self.text_len)
        x_BSD = Block.forward(self, x_BSD, allowed_BSS)
        return torch.cat([x_BSD, meta_BS2.to(x_BSD.dtype)], dim=-1)


class M6Head(nn.Module):
    """Final LayerNorm and the head: logits over the text positions [B, L, V]."""

    def __init__(self, model: M6Model):
        super().__init__()
        self.ln_f = model.ln_f
        self.weight = nn.Parameter(model.tok_embed.weight.detach().clone())
        self.n_patches = model.n_patches

    def forward(self, packed_BSX: torch.Tensor) -> torch.Tensor:
        h_BLD = self.ln_f(packed_BSX[:, self.n_patches :, :-2])
        return h_BLD @ self.weight.t()


def to_sequential(model: M6Model, image_shape) -> tuple[nn.Sequential, dict[str, str]]:
    """(the stages' nn.Sequential sharing `model`'s modules, {its tensor names: the
    single-process names}): parameters and buffers, the head's copy named tok_embed.weight."""
    n, L = model.n_patches, model.text_len
    children = [("embed", M6Embed(model, tuple(image_shape)))]
    children += [(f"blocks_{i}", M6PipeBlock(b, n, L)) for i, b in enumerate(model.blocks)]
    children.append(("head", M6Head(model)))
    seq = nn.Sequential(OrderedDict(children))
    single = {id(t): name for name, t in _tensors(model)}
    names = {name: single[id(t)] for name, t in _tensors(seq) if name != TIED}
    names[TIED] = "tok_embed.weight"
    return seq, names


def _tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
