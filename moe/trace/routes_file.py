"""Reading a router-replay routes file (safetensors), which is untrusted: a regular file only
(moe.untrusted.open_regular: a FIFO would block, a directory is no file), the header's length
checked against the file before it is read, the header and the layer list parsed as bounded
JSON (moe.untrusted.parse_json: nesting depth, duplicate keys), every tensor's dtype, shape and
byte range checked before any tensor is allocated, and the data read from the one open file.
Every problem is one RoutesFileError naming the file."""

import math
import os

import torch

from moe.untrusted import UntrustedFileError, open_regular, safetensors_header

DTYPES = {"I64": torch.int64, "I32": torch.int32, "F64": torch.float64, "F32": torch.float32,
          "F16": torch.float16, "BF16": torch.bfloat16}  # fmt: skip


class RoutesFileError(UntrustedFileError):
    """A routes file that cannot be replayed (nothing was changed)."""


def read_safetensors(path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, name -> CPU tensor) of the safetensors file `path`; dtypes limited to DTYPES."""
    where = f"routes file {str(path)!r}"
    with open_regular(path, error=RoutesFileError, what="routes file") as f:
        size = os.fstat(f.fileno()).st_size
        header, n = safetensors_header(f, where, error=RoutesFileError)
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise RoutesFileError(f"{where}: __metadata__ must map names to strings")
        entries = {key: _entry(where, key, entry, size - 8 - n) for key, entry in header.items()}
        tensors = {}
        for key, (dtype, shape, begin, end) in entries.items():
            f.seek(8 + n + begin)
            data = f.read(end - begin)
            if len(data) != end - begin:
                raise RoutesFileError(f"{where}: the file ended inside tensor {key!r:.100}")
            flat = (
                torch.frombuffer(bytearray(data), dtype=dtype)
                if data
                else torch.empty(0, dtype=dtype)
            )
            tensors[key] = flat.reshape(shape)
    return metadata, tensors


def _entry(where: str, key: str, entry, data_bytes: int) -> tuple[torch.dtype, list, int, int]:
    """(dtype, shape, begin, end) of one header entry, checked: the bytes lie in the file's
    data and are exactly dtype x shape long."""
    ok = (
        isinstance(entry, dict)
        and entry.get("dtype") in DTYPES
        and isinstance(entry.get("shape"), list)
        and all(_small_int(d) for d in entry["shape"])
        and isinstance(entry.get("data_offsets"), list)
        and len(entry["data_offsets"]) == 2
        and all(_small_int(o) for o in entry["data_offsets"])
    )
    if not ok:
        raise RoutesFileError(f"{where}: malformed header entry for {key!r:.100}")
    dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
    begin, end = entry["data_offsets"]
    length = math.prod(shape) * dtype.itemsize
    if not begin <= end <= data_bytes or end - begin != length:
        raise RoutesFileError(
            f"{where}: tensor {key!r:.100} of {length} bytes does not fit its offsets "
            f"[{begin}, {end}) in {data_bytes} bytes of data"
        )
    return dtype, shape, begin, end


def _small_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


__all__ = ["RoutesFileError", "read_safetensors"]
