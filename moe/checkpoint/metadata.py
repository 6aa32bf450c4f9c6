"""The checkpoint's metadata as JSON (never a pickle) and its strict validation.

`metadata.json` in a checkpoint directory:
    {"format": "moe-dcp", "version": 2,
     "tensors": {key: {"dtype": "float32", "shape": [...],
                       "chunks": [{"offsets": [...], "sizes": [...], "file": "data-00000.bin",
                                   "offset": 0, "length": 24, "crc32": 123}]}},
     "objects": {... every non-tensor value: hyperparameters, `extra`, ...,
                 "layout": {"pp": 2, "dp": 1, "ep": 2}}}
`layout` is the (pp, dp, ep) the checkpoint was saved at (absent before issue 47): any
layout loads any checkpoint, it is recorded to name both layouts when a load is refused.
Validation checks every field's type, that every chunk lies inside its tensor, that the chunks
tile it exactly (no overlap, no gap), that each chunk's byte length equals dtype x shape and
lies inside a regular file inside the checkpoint directory, all before any tensor is allocated.
"""

import math
import os
from dataclasses import dataclass

import torch

from moe.checkpoint.errors import CheckpointError

FORMAT, VERSION = "moe-dcp", 2
METADATA = "metadata.json"
LAYOUT, LAYOUT_DIMS = "layout", ("pp", "dp", "ep")
DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32: int

    def to_json(self) -> dict:
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "crc32": self.crc32,
        }


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    def to_json(self) -> dict:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "chunks": [c.to_json() for c in self.chunks],
        }


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"cannot checkpoint tensors of dtype {name}")
    return name


def _field(obj: dict, key: str, kind, where: str):
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise CheckpointError(f"{where}: missing key {key!r}")
    value = obj[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise CheckpointError(f"{where}.{key}: expected {kind.__name__}, got {value!r:.80}")
    return value


def _ints(obj: dict, key: str, where: str, minimum: int) -> tuple[int, ...]:
    values = _field(obj, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in values):
        raise CheckpointError(f"{where}.{key}: expected integers >= {minimum}, got {values!r:.80}")
    return tuple(values)


def resolve_file(directory: str, name: str, where: str) -> str:
    """The real path of `name`, refusing anything that leaves `directory`."""
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise CheckpointError(f"{where}: file {name!r} is not a plain name inside the checkpoint")
    root = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, real]) != root or real == root:
        raise CheckpointError(f"{where}: file {name!r} resolves to {real!r}, outside {root!r}")
    if not os.path.isfile(real):
        raise CheckpointError(f"{where}: file {name!r} is missing or not a regular file")
    return real


def _chunk(raw, key: str, i: int, entry: TensorEntry, directory: str, sizes: dict) -> Chunk:
    where = f"tensors[{key!r}].chunks[{i}]"
    offsets = _ints(raw, "offsets", where, 0)
    csizes = _ints(raw, "sizes", where, 0)
    if len(offsets) != len(entry.shape) or len(csizes) != len(entry.shape):
        raise CheckpointError(f"{where}: offsets/sizes rank differs from shape {entry.shape}")
    if any(o + s > d for o, s, d in zip(offsets, csizes, entry.shape)):
        raise CheckpointError(f"{where}: chunk {offsets}+{csizes} exceeds shape {entry.shape}")
    file = _field(raw, "file", str, where)
    offset = _field(raw, "offset", int, where)
    length = _field(raw, "length", int, where)
    crc = _field(raw, "crc32", int, where)
    if offset < 0 or length < 0:
        raise CheckpointError(f"{where}: negative offset {offset} or length {length}")
    want = math.prod(csizes) * entry.dtype.itemsize
    if length != want:
        raise CheckpointError(
            f"{where}: length {length} bytes, but {entry.dtype} x {list(csizes)} is {want}"
        )
    if file not in sizes:  # once per file, not per chunk
        sizes[file] = os.path.getsize(resolve_file(directory, file, f"tensor {key!r}"))
    size = sizes[file]
    if offset + length > size:
        raise CheckpointError(
            f"tensor {key!r}: bytes {offset}..{offset + length} lie beyond the end of "
            f"{file!r} ({size} bytes; truncated or forged)"
        )
    return Chunk(offsets, csizes, file, offset, length, crc)


def _check_tiling(key: str, entry: TensorEntry) -> None:
    """Chunks must cover the tensor exactly once. Every layout DCP writes (one chunk per
    DTensor shard) is a grid: the product of one partition per dimension. That is checked in
    O(n log n) for n chunks (a pairwise overlap test would be quadratic in forged metadata)."""
    chunks = [c for c in entry.chunks if math.prod(c.sizes) > 0]
    total = math.prod(entry.shape)
    covered = sum(math.prod(c.sizes) for c in chunks)
    starts: set[tuple[int, ...]] = set()
    for c in chunks:
        if c.offsets in starts:
            raise CheckpointError(f"tensor {key!r}: chunks at {list(c.offsets)} overlap")
        starts.add(c.offsets)
    for dim in range(len(entry.shape)):
        spans = sorted({(c.offsets[dim], c.sizes[dim]) for c in chunks})
        for (a, na), (b, _) in zip(spans, spans[1:]):
            if b < a + na:
                raise CheckpointError(
                    f"tensor {key!r}: chunks overlap or do not form a grid in dim {dim} "
                    f"(spans {a}+{na} and {b}...); every layout DCP writes is a grid"
                )
    if covered != total:
        raise CheckpointError(f"tensor {key!r}: chunks cover {covered} of {total} elements")


def parse(raw, directory: str) -> tuple[dict[str, TensorEntry], dict]:
    """Validate decoded metadata JSON; returns (tensors by key, objects)."""
    fmt = _field(raw, "format", str, "metadata")
    version = _field(raw, "version", int, "metadata")
    if fmt != FORMAT or version != VERSION:
        raise CheckpointError(
            f"metadata: format {fmt!r} version {version}, this reader reads {FORMAT!r} v{VERSION}"
        )
    tensors_raw = _field(raw, "tensors", dict, "metadata")
    objects = _field(raw, "objects", dict, "metadata")
    tensors, sizes = {}, {}
    for key, t in tensors_raw.items():
        where = f"tensors[{key!r}]"
        name = _field(t, "dtype", str, where)
        if name not in DTYPES:
            raise CheckpointError(f"{where}.dtype: unsupported dtype {name!r}")
        shape = _ints(t, "shape", where, 0)
        entry = TensorEntry(DTYPES[name], shape, ())
        raws = _field(t, "chunks", list, where)
        chunks = tuple(_chunk(c, key, i, entry, directory, sizes) for i, c in enumerate(raws))
        entry = TensorEntry(entry.dtype, shape, chunks)
        _check_tiling(key, entry)
        tensors[key] = entry
    return tensors, objects


def parse_layout(raw) -> dict[str, int] | None:
    """objects.layout validated: None (not recorded) or {"pp", "dp", "ep"} ints >= 1."""
    if raw is None:
        return None
    ok = isinstance(raw, dict) and set(raw) == set(LAYOUT_DIMS)
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in raw.values())
    if not ok:
        raise CheckpointError(
            f"metadata: objects.{LAYOUT} must map {', '.join(LAYOUT_DIMS)} to ints >= 1, "
            f"got {raw!r:.80}"
        )
    return {k: raw[k] for k in LAYOUT_DIMS}
