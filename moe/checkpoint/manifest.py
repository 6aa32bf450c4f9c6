"""The checkpoint manifest read as untrusted input: its schema, and bounded tensor reads.

Everything a manifest says is checked before it is used: the format and version, every
field's type, that each tensor's file is a plain name inside the checkpoint directory (no
`..`, no absolute path, no symlink leading out), and that each declared byte count equals
dtype x shape and fits in the file, before a single byte is allocated.
"""

import json
import math
import os
import zlib

import torch

FORMAT, VERSION = "moe-checkpoint", 1
MAX_MANIFEST_BYTES = 256 * 2**20
DTYPES = {
    str(dt): dt
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
_ENTRY_TYPES = {
    "kind": str,
    "name": str,
    "file": str,
    "offset": int,
    "nbytes": int,
    "dtype": str,
    "shape": list,
    "crc32": int,
}


class CheckpointError(ValueError):
    """A checkpoint that is malformed, unsafe, incomplete or does not match the model."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def entry_key(entry: dict) -> str:
    key = f"{entry['kind']}/{entry['name']}" + (f"/{entry['state']}" if entry["state"] else "")
    return key if entry["expert"] is None else f"{key}#expert={entry['expert']}"


def _check_entry(key: str, entry) -> None:
    if not isinstance(entry, dict):
        raise CheckpointError(f"manifest: tensor {key!r} is not an object")
    for field, kind in _ENTRY_TYPES.items():
        value = entry.get(field)
        ok = _is_int(value) if kind is int else isinstance(value, kind)
        if not ok:
            raise CheckpointError(
                f"manifest: tensor {key!r} field {field!r} must be {kind.__name__}, got {value!r}"
            )
    if entry["kind"] not in ("model", "optim"):
        raise CheckpointError(f"manifest: tensor {key!r} has kind {entry['kind']!r}")
    if not (entry.get("state") is None or isinstance(entry.get("state"), str)):
        raise CheckpointError(f"manifest: tensor {key!r} field 'state' must be str or null")
    expert = entry.get("expert")
    if not (expert is None or (_is_int(expert) and expert >= 0)):
        raise CheckpointError(f"manifest: tensor {key!r} field 'expert' must be an int >= 0")
    if entry.get("python") not in (None, "int", "float", "bool"):
        raise CheckpointError(f"manifest: tensor {key!r} field 'python' is {entry['python']!r}")
    if entry["dtype"] not in DTYPES:
        raise CheckpointError(f"manifest: tensor {key!r} has unsupported dtype {entry['dtype']!r}")
    shape = entry["shape"]
    if not all(_is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(f"manifest: tensor {key!r} has a bad shape {shape!r}")
    expected = math.prod(shape) * DTYPES[entry["dtype"]].itemsize
    if entry["nbytes"] != expected or entry["offset"] < 0:
        raise CheckpointError(
            f"manifest: tensor {key!r} declares {entry['nbytes']} bytes at offset "
            f"{entry['offset']}; {entry['dtype']}{shape} is {expected} bytes"
        )
    if entry_key(entry) != key:
        raise CheckpointError(f"manifest: tensor {key!r} describes {entry_key(entry)!r}")


def check_manifest(manifest, where: str) -> dict:
    """The manifest if it is well formed; else CheckpointError naming the problem."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: the manifest is not a JSON object")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{where} is not a {FORMAT} v{VERSION} checkpoint (format "
            f"{manifest.get('format')!r}, version {manifest.get('version')!r})"
        )
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{where}: manifest field 'tensors' must be an object")
    for key, entry in tensors.items():
        _check_entry(key, entry)
    for field in ("optimizer", "extra"):
        if not (manifest.get(field) is None or isinstance(manifest.get(field), dict)):
            raise CheckpointError(f"{where}: manifest field {field!r} must be an object or null")
    optimizer = manifest.get("optimizer") or {}
    if not isinstance(optimizer.get("param_groups", []), list) or not all(
        isinstance(g, dict) for g in optimizer.get("param_groups", [])
    ):
        raise CheckpointError(f"{where}: manifest optimizer param_groups must be a list of objects")
    return manifest


def load_manifest(directory: str) -> dict:
    path = os.path.join(directory, "manifest.json")
    try:
        if os.path.getsize(path) > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes")
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest in {directory} is unreadable: {e}") from e
    return check_manifest(manifest, directory)


def data_file(directory: str, key: str, name: str) -> str:
    """The path of a tensor's data file, which must be a plain file inside `directory`."""
    if not name or name in (".", "..") or os.path.basename(name) != name or "\\" in name:
        raise CheckpointError(f"{key}: data file {name!r} is not a plain file name")
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(path) != root:
        raise CheckpointError(f"{key}: data file {name!r} resolves outside the checkpoint")
    return path


def read_tensor(directory: str, key: str, entry: dict) -> torch.Tensor:
    """The tensor `entry` describes (checked by check_manifest), read with bounded memory."""
    path = data_file(directory, key, entry["file"])
    start, nbytes = entry["offset"], entry["nbytes"]
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if start + nbytes > size:
                raise CheckpointError(
                    f"{key}: {entry['file']} is truncated (needs bytes {start}..{start + nbytes}, "
                    f"the file has {size})"
                )
            f.seek(start)
            data = f.read(nbytes)
    except OSError as e:
        raise CheckpointError(f"{key}: cannot read {entry['file']}: {e}") from e
    if len(data) != nbytes:
        raise CheckpointError(f"{key}: {entry['file']} changed while being read")
    if zlib.crc32(data) != entry["crc32"]:
        raise CheckpointError(f"{key}: checksum mismatch in {entry['file']} (corrupted data)")
    dtype = DTYPES[entry["dtype"]]
    if not nbytes:
        return torch.empty(entry["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(entry["shape"])
