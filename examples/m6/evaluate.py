"""Held-out evaluation: teacher-forced loss and greedy captions, sharded over ranks.

Every rank runs the same number of forward passes (its shard is padded to equal size), as
expert parallelism needs: each forward is a collective over the EP group.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.m6.data import IGNORE, Batch, Dataset, Encoded, Example, encode, make_batch
from examples.m6.runtime import Runtime


@torch.no_grad()
def greedy_generate(model, batch: Batch, bos_id: int, pad_id: int, autocast=None) -> torch.Tensor:
    """Text after <bos> generated token by token (argmax); returns text_BL.

    The prefix is the prompt; everything after <bos> is replaced by the model's choices.
    A fixed number of steps for every rank (no early stop), so EP collectives line up.
    """
    text_BL = batch.text_BL.clone()
    B, L = text_BL.shape
    rows_B = torch.arange(B, device=text_BL.device)
    start_B = batch.prompt_len_B + 1  # first generated position
    pos_L = torch.arange(L, device=text_BL.device)
    text_BL = torch.where(pos_L[None] < start_B[:, None], text_BL, pad_id)
    text_BL[rows_B, batch.prompt_len_B] = bos_id
    for t in range(L - int(batch.prompt_len_B.min()) - 1):
        with autocast or nullcontext():
            logits_BLV = model(batch.images_BCHW, text_BL, batch.prompt_len_B, batch.has_image_B)
        cur_B = start_B + t
        live_B = cur_B < L
        cur_B = cur_B.clamp_max(L - 1)
        next_B = logits_BLV[rows_B, cur_B - 1].argmax(-1)
        text_BL[rows_B, cur_B] = torch.where(live_B, next_B, text_BL[rows_B, cur_B])
    return text_BL


def _padded_shard(n: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's contiguous share of n items, padded to ceil(n / world) (weight 0 on padding)."""
    per = -(-n // world)
    idx = torch.arange(rank * per, (rank + 1) * per)
    valid = idx < n
    return torch.where(valid, idx, 0), valid


@torch.no_grad()
def evaluate(
    model,
    data: Dataset,
    examples: list[Example],
    text_len: int,
    rt: Runtime,
    batch_size: int = 256,
    generate: bool = True,
    keep_samples: int = 8,
) -> dict:
    """Loss per target token and exact-match accuracy of greedy generations on `examples`."""
    was_training = model.training
    model.eval()
    enc: Encoded = encode(examples, data.vocab, text_len)
    idx, valid = _padded_shard(len(examples), rt.rank, rt.world)
    sums = torch.zeros(4, dtype=torch.float64)  # loss sum, target tokens, correct, examples
    samples = []
    for chunk, ok in zip(idx.split(batch_size), valid.split(batch_size)):
        batch = make_batch(data, enc, chunk).to(rt.device)
        ok_dev = ok.to(rt.device)
        with rt.autocast:
            logits_BLV = model(
                batch.images_BCHW, batch.text_BL, batch.prompt_len_B, batch.has_image_B
            )
        labels_BL = torch.where(ok_dev[:, None], batch.labels_BL, IGNORE)
        sums[0] += F.cross_entropy(
            logits_BLV.float().flatten(0, 1),
            labels_BL.flatten(),
            ignore_index=IGNORE,
            reduction="sum",
        ).item()
        sums[1] += int((labels_BL != IGNORE).sum())
        if not generate:
            continue
        text_BL = greedy_generate(model, batch, data.vocab.bos, data.vocab.pad, rt.autocast).cpu()
        for row, (i, good) in enumerate(zip(chunk.tolist(), ok.tolist())):
            if not good:
                continue
            p = int(enc.prompt_len_N[i])
            said = data.vocab.decode(text_BL[row, p + 1 :].tolist())
            hit = said == " ".join(examples[i].target.lower().split())
            sums[2] += hit
            sums[3] += 1
            if len(samples) < keep_samples:
                samples.append({"example": i, "generated": said, "correct": hit})
    if rt.world > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    return {
        "loss": float(sums[0] / max(sums[1], 1)),
        "accuracy": float(sums[2] / sums[3]) if generate and sums[3] else None,
        "correct": int(sums[2]),
        "total": int(sums[3]),
        "samples": samples,
    }
