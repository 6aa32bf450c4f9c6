"""scikit-learn's digits as image + caption batches for a tiny Qwen3-VL-MoE (transformers'
own classes, random weights, built here: nothing is downloaded).

The images, captions, vocabulary and held-out split are the M6 example's (examples/m6/data.py:
"describe the image" -> "a photo of the digit seven"). A sequence is the image's 4 tokens
(8 x 8 pixels in 2 x 2 patches, 2 x 2 patches merged into one token, as Qwen3-VL merges them),
the prompt, <bos>, the caption and <eos>; the loss is on the caption. A step's batch is a pure
function of (seed, step), so a resumed run and any number of ranks see the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from examples.m6 import data as m6data

PATCH, MERGE, SIDE = 2, 2, 8  # pixels per patch side, patches per merged token side, image side
GRID = SIDE // PATCH  # patches per image side
IMAGE_TOKENS = (GRID // MERGE) ** 2


@dataclass
class DigitsVL:
    """The training and held-out examples, encoded once."""

    vocab: m6data.Vocab
    images_NCHW: torch.Tensor
    train: m6data.Encoded
    test: m6data.Encoded
    test_captions: list[str]

    @property
    def image_token(self) -> int:
        """The image placeholder's id: one past the words."""
        return len(self.vocab)


def load(seed: int = 0) -> DigitsVL:
    """The digits with M6's captions and split; only the image-to-caption examples."""
    data = m6data.load_digits(seed=seed)
    train = [e for e in data.train if e.image >= 0 and e.prompt == m6data.DESCRIBE]
    text_len = max(len(e.prompt.split()) + len(e.target.split()) + 2 for e in train + data.test)
    return DigitsVL(
        data.vocab,
        data.images_NCHW,
        m6data.encode(train, data.vocab, text_len),
        m6data.encode(data.test, data.vocab, text_len),
        [e.target for e in data.test],
    )


def tiny_qwen3_vl_moe(vocab_size: int, image_token: int):
    """A tiny Qwen3-VL-MoE from its config class: a 2-block vision tower on 1-channel 2 x 2
    patches, a 2-layer MoE language model (8 experts, top-2)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    width = 64
    text = dict(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width,
        moe_intermediate_size=width // 2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2]),
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=width, intermediate_size=2 * width, num_heads=2, in_channels=1,
        patch_size=PATCH, temporal_patch_size=1, spatial_merge_size=MERGE,
        out_hidden_size=width, num_position_embeddings=GRID**2, deepstack_visual_indexes=[],
    )  # fmt: skip
    config = Qwen3VLMoeConfig(
        text_config=text, vision_config=vision, image_token_id=image_token,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3VLMoeForConditionalGeneration(config)


def pixel_values(images_BCHW: torch.Tensor) -> torch.Tensor:
    """[B, 1, 8, 8] -> [B * 16, 4]: one row per patch, the patches of each merged 2 x 2 window
    consecutive (the order of Qwen3-VL's image processor)."""
    B, C = images_BCHW.shape[:2]
    m, g, p = MERGE, GRID // MERGE, PATCH
    x = images_BCHW.reshape(B, C, g, m, p, g, m, p)  # rows: (window, in-window, pixel)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # B, window row, window col, m, m, C, p, p
    return x.reshape(B * GRID * GRID, C * p * p)


def model_inputs(data: DigitsVL, images_B: torch.Tensor, text_BL: torch.Tensor, device) -> dict:
    """The keyword arguments of the model's forward for these images and text rows, on
    `device`."""
    B = text_BL.shape[0]
    image = torch.full((B, IMAGE_TOKENS), data.image_token, dtype=text_BL.dtype)
    ids = torch.cat([image, text_BL], dim=1)
    tensors = dict(
        input_ids=ids,
        pixel_values=pixel_values(data.images_NCHW[images_B]),
        image_grid_thw=torch.tensor([[1, GRID, GRID]]).expand(B, 3),
        mm_token_type_ids=(ids == data.image_token).int(),
    )
    moved = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
    return dict(moved, use_cache=False)  # full forwards only: no key/value cache to build


def batch_indices(data: DigitsVL, step: int, batch: int, seed: int) -> torch.Tensor:
    """Training example indices of `step`'s global batch (consecutive slices of per-epoch
    shuffles, M6's rule)."""
    return m6data.global_batch_indices(step, len(data.train), batch, seed)


def caption_loss(model, data: DigitsVL, idx: torch.Tensor, device) -> torch.Tensor:
    """Mean cross-entropy of the caption tokens (<eos> included) of training examples `idx`."""
    enc = data.train
    inputs = model_inputs(data, enc.image_N[idx], enc.text_NL[idx], device)
    logits = model(**inputs).logits[:, IMAGE_TOKENS:]
    labels = enc.labels_NL[idx].to(device)  # already the next token of each position
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


@torch.no_grad()
def greedy_captions(model, data: DigitsVL, device, rows: int = 512) -> list[str]:
    """Every held-out image's caption, generated greedily after its prompt and <bos> (a full
    forward per token: the same work on every rank, which expert parallelism needs)."""
    enc, out = data.test, []
    new = enc.text_NL.shape[1] - int(enc.prompt_len_N.max()) - 1
    for start in range(0, len(enc), rows):
        idx = torch.arange(start, min(start + rows, len(enc)))
        text = enc.text_NL[idx, : int(enc.prompt_len_N[idx].max()) + 1]  # prompt, <bos>
        for _ in range(new):
            logits = model(**model_inputs(data, enc.image_N[idx], text, device)).logits
            words = logits[:, -1:, : data.image_token]  # never the image placeholder
            text = torch.cat([text, words.argmax(-1).cpu()], dim=1)
        prompt = int(enc.prompt_len_N[idx].max()) + 1
        out += [data.vocab.decode(row) for row in text[:, prompt:].tolist()]
    return out
