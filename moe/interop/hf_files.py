"""Reading the files of a Hugging Face safetensors checkpoint, which are untrusted: the index
(moe.untrusted.read_json: regular file inside the directory, bounded size and depth, a key
listed twice refused) and each file's safetensors header, parsed here so that every problem is
an HFCheckpointError naming the file; a key stored in two files is refused."""

import math
import os

from moe.untrusted import containing_folder, open_regular, read_json, safetensors_header

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
MAX_INDEX_BYTES = 64 << 20
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that does not fit the model (nothing was changed)."""


def inside(directory: str, name: str) -> str:
    """The real path of the file `name` of `directory`: a plain name (no folder part) whose
    real path lies in the directory or, for a hub-cache snapshot, in its cache repository
    (moe.untrusted.containing_folder: the snapshot's links lead to ../../blobs/<sha>)."""
    if os.path.basename(name) != name or name in ("", ".", ".."):
        raise HFCheckpointError(f"{directory}: file {name!r} is not a plain file in the directory")
    top = containing_folder(directory)
    path = os.path.realpath(os.path.join(os.path.realpath(directory), name))
    if os.path.commonpath([top, path]) != top or path == top:
        raise HFCheckpointError(f"{directory}: file {name!r} resolves to {path!r}, outside {top!r}")
    return path


def read_index(directory: str) -> dict:
    """The index JSON (untrusted: a regular file inside the directory, bounded, no duplicate
    keys, so a key listed twice is refused)."""
    return read_json(
        os.path.join(directory, INDEX),
        MAX_INDEX_BYTES,
        root=directory,
        error=HFCheckpointError,
        what="safetensors index",
    )


def weight_map_of(directory: str) -> dict[str, str] | None:
    """hub key -> file path from the index, or None when there is no index."""
    if not os.path.lexists(os.path.join(directory, INDEX)):
        return None
    doc = read_index(directory)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFCheckpointError(f"{directory}/{INDEX}: 'weight_map' must map keys to file names")
    return {k: inside(directory, v) for k, v in weight_map.items()}


def _header(file: str, directory: str) -> dict[str, tuple[tuple, str]]:
    """hub key -> (shape, dtype) from one safetensors header, read and checked here (the
    8-byte length, then JSON) so that every problem names the file; no tensor data is read."""
    where = f"safetensors file {file!r}"
    with open_regular(file, root=directory, error=HFCheckpointError, what="safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        doc, n = safetensors_header(f, where, error=HFCheckpointError)
    out, data = {}, size - 8 - n
    for key, entry in doc.items():
        if key == "__metadata__":
            continue
        if not _header_entry_ok(entry, data):
            raise HFCheckpointError(f"{where}: malformed header entry for {key!r:.100}")
        out[key] = (tuple(entry["shape"]), entry["dtype"])
    return out


def _header_entry_ok(entry, data_bytes: int) -> bool:
    """dtype known, shape and data_offsets non-negative ints, the bytes inside the file and
    exactly dtype x shape long."""
    if not isinstance(entry, dict) or entry.get("dtype") not in _ITEMSIZE:
        return False
    shape, span = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(span, list) or len(span) != 2:
        return False
    if not all(type(v) is int and v >= 0 for v in [*shape, *span]):
        return False
    want = math.prod(shape) * _ITEMSIZE[entry["dtype"]]
    return span[0] <= span[1] <= data_bytes and span[1] - span[0] == want


def headers_of(files: set[str], directory: str) -> tuple[dict, dict]:
    """(hub key -> (shape, dtype), hub key -> file) over every file; a key stored in two
    files is refused (its shape would be checked in one and its data read from the other)."""
    out, where = {}, {}
    for file in sorted(files):
        for key, value in _header(file, directory).items():
            if key in where:
                raise HFCheckpointError(
                    f"{directory}: key {key!r} is stored in both {os.path.basename(where[key])!r} "
                    f"and {os.path.basename(file)!r}"
                )
            out[key], where[key] = value, file
    return out, where
