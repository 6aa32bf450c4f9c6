"""Image-caption data for the M6 example: scikit-learn's digits (no download) or a folder.

Every example is (image or none, prompt, target): image-to-text ("describe the image" ->
caption) and text-to-text (M6's two single-stream objectives). Examples are encoded once
into fixed-length tensors; a training step's global batch is a pure function of
(seed, step), so resuming and any number of ranks see exactly the same data.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
IGNORE = -100  # label of positions without a loss
DESCRIBE = "describe the image"
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


class Vocab:
    """Whitespace word vocabulary with <pad>=0, <bos>, <eos>, <unk>."""

    def __init__(self, words: list[str]):
        self.words = list(SPECIALS) + sorted(set(words) - set(SPECIALS))
        self.index = {w: i for i, w in enumerate(self.words)}
        self.pad, self.bos, self.eos, self.unk = (self.index[s] for s in SPECIALS)

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        return [self.index.get(w, self.unk) for w in text.lower().split()]

    def decode(self, ids: list[int]) -> str:
        """Words up to the first <eos>, specials dropped."""
        out = []
        for i in ids:
            if i == self.eos:
                break
            if i not in (self.pad, self.bos):
                out.append(self.words[i] if i < len(self.words) else UNK)
        return " ".join(out)


@dataclass(frozen=True)
class Example:
    image: int  # index into images_NCHW, -1: text only
    prompt: str
    target: str


@dataclass
class Dataset:
    """Images, the training examples and the held-out image-to-text examples."""

    name: str
    vocab: Vocab
    images_NCHW: torch.Tensor  # float, roughly in [-1, 1]
    train: list[Example]
    test: list[Example]  # held-out images, prompt DESCRIBE
    text_pairs: list[Example]  # text-to-text examples to report accuracy on
    labels: list[str] | None = None  # per image, for printing samples


@dataclass
class Encoded:
    """Examples as tensors (N examples, L = text_len)."""

    image_N: torch.Tensor  # long, -1: no image
    text_NL: torch.Tensor  # prompt, <bos>, target, <eos>, <pad>...
    prompt_len_N: torch.Tensor
    labels_NL: torch.Tensor  # next token over <bos>..target, IGNORE elsewhere
    truncated: int  # examples whose target was cut to fit text_len

    def __len__(self) -> int:
        return self.text_NL.shape[0]


def encode(examples: list[Example], vocab: Vocab, text_len: int) -> Encoded:
    """Fixed-length encoding; a target too long for text_len is cut (the prompt never is)."""
    N = len(examples)
    text_NL = torch.full((N, text_len), vocab.pad, dtype=torch.long)
    labels_NL = torch.full((N, text_len), IGNORE, dtype=torch.long)
    prompt_len_N = torch.zeros(N, dtype=torch.long)
    truncated = 0
    for n, ex in enumerate(examples):
        prompt, target = vocab.encode(ex.prompt), vocab.encode(ex.target) + [vocab.eos]
        if not prompt:
            raise ValueError(f"example {n}: empty prompt (the prefix needs at least one token)")
        room = text_len - len(prompt) - 1
        if room < 1:
            raise ValueError(f"example {n}: prompt {ex.prompt!r} does not fit text_len={text_len}")
        if len(target) > room:
            target, truncated = target[:room], truncated + 1
        seq = prompt + [vocab.bos] + target
        text_NL[n, : len(seq)] = torch.tensor(seq)
        p = len(prompt)
        labels_NL[n, p : p + len(target)] = torch.tensor(target)
        prompt_len_N[n] = p
    image_N = torch.tensor([ex.image for ex in examples], dtype=torch.long)
    return Encoded(image_N, text_NL, prompt_len_N, labels_NL, truncated)


@dataclass
class Batch:
    images_BCHW: torch.Tensor
    text_BL: torch.Tensor
    prompt_len_B: torch.Tensor
    has_image_B: torch.Tensor
    labels_BL: torch.Tensor

    def to(self, device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in vars(self).values()))

    def __len__(self) -> int:
        return self.text_BL.shape[0]


def make_batch(data: Dataset, enc: Encoded, idx_B: torch.Tensor) -> Batch:
    image_B = enc.image_N[idx_B]
    images = data.images_NCHW[image_B.clamp_min(0)] * (image_B >= 0).view(-1, 1, 1, 1)
    return Batch(
        images, enc.text_NL[idx_B], enc.prompt_len_N[idx_B], image_B >= 0, enc.labels_NL[idx_B]
    )


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def global_batch_indices(step: int, n: int, global_batch: int, seed: int) -> torch.Tensor:
    """Example indices of step's global batch: consecutive slices of per-epoch shuffles."""
    parts, start, need = [], step * global_batch, global_batch
    while need:
        epoch, offset = divmod(start, n)
        take = min(need, n - offset)
        parts.append(_epoch_order(n, seed, epoch)[offset : offset + take])
        start, need = start + take, need - take
    return torch.cat(parts)


def shard(idx: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's contiguous slice of a global batch (world must divide its size)."""
    per = idx.shape[0] // world
    return idx[rank * per : (rank + 1) * per]


# -- scikit-learn digits ------------------------------------------------------------------
def digit_caption(label: int) -> str:
    return f"a photo of the digit {DIGIT_WORDS[label]}"


def digit_text_pairs() -> list[Example]:
    """Text-to-text: digits to words and counting."""
    pairs = [Example(-1, f"write {d} in words", w) for d, w in enumerate(DIGIT_WORDS)]
    pairs += [Example(-1, f"what comes after {a}", b) for a, b in zip(DIGIT_WORDS, DIGIT_WORDS[1:])]
    return pairs


def load_digits(test_fraction: float = 0.2, seed: int = 0, text_repeat: int = 16) -> Dataset:
    """scikit-learn's 1797 handwritten 8x8 digits (shipped with the package) with captions
    built from their labels. Held-out images (a seeded split) measure caption accuracy."""
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 8.0 - 1.0
    labels = [int(y) for y in digits.target]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = int(round(test_fraction * len(order)))
    test_ids, train_ids = order[:n_test], order[n_test:]
    train = []
    for i in train_ids:
        train.append(Example(i, DESCRIBE, digit_caption(labels[i])))
        train.append(Example(i, "what digit is this", DIGIT_WORDS[labels[i]]))
    text_pairs = digit_text_pairs()
    train += text_pairs * text_repeat
    test = [Example(i, DESCRIBE, digit_caption(labels[i])) for i in test_ids]
    words = " ".join(f"{e.prompt} {e.target}" for e in train).split()
    return Dataset(
        "digits", Vocab(words), images, train, test, text_pairs, [DIGIT_WORDS[y] for y in labels]
    )


# -- a folder of images and captions -------------------------------------------------------
def load_folder(
    path: str | Path, image_size: int, channels: int, test_fraction: float = 0.1, seed: int = 0
) -> Dataset:
    """DIR/captions.jsonl, one {"image": "relative/path.png", "caption": "..."} per line
    (optional "prompt", default "describe the image"). Images are resized to image_size.
    Text-to-text examples complete each caption from its first half (prefix LM)."""
    from PIL import Image

    root = Path(path)
    index = root / "captions.jsonl"
    if not index.is_file():
        raise FileNotFoundError(f"{index} not found: expected one JSON object per line")
    records = []
    for line_no, line in enumerate(index.read_text().splitlines(), 1):
        if line.strip():
            rec = json.loads(line)
            if "image" not in rec or "caption" not in rec:
                raise ValueError(f"{index}:{line_no}: needs keys 'image' and 'caption'")
            records.append(rec)
    if len(records) < 2:
        raise ValueError(f"{index}: needs at least 2 records, got {len(records)}")
    mode = "L" if channels == 1 else "RGB"
    tensors = []
    for rec in records:
        img = Image.open(root / rec["image"]).convert(mode).resize((image_size, image_size))
        t = torch.tensor(np.asarray(img), dtype=torch.float32) / 127.5 - 1.0
        tensors.append(t.view(image_size, image_size, channels).permute(2, 0, 1))
    images = torch.stack(tensors)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = max(1, int(round(test_fraction * len(records))))
    train, test, text_pairs = [], [], []
    for pos, i in enumerate(order):
        rec = records[i]
        example = Example(i, rec.get("prompt", DESCRIBE), rec["caption"])
        (test if pos < n_test else train).append(example)
        words = rec["caption"].split()
        if pos >= n_test and len(words) >= 2:
            half = len(words) // 2
            text_pairs.append(Example(-1, " ".join(words[:half]), " ".join(words[half:])))
    train += text_pairs
    words = " ".join(f"{e.prompt} {e.target}" for e in train + test).split()
    return Dataset(root.name, Vocab(words), images, train, test, text_pairs)
