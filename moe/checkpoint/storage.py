"""Pickle-free storage for torch.distributed.checkpoint: raw tensor bytes + JSON metadata.

DCP's FileSystemWriter/Reader keep metadata as a pickle and non-tensor values as torch.save'd
blobs. These replacements write each rank's tensor chunks as raw bytes into `data-<rank>.bin`
(with a CRC-32 per chunk) and the metadata as JSON; non-tensor values never reach DCP (the
caller stores them as JSON in `objects`) and the reader refuses any BYTE_IO request.
"""

import json
import os
import zlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from moe.checkpoint import metadata as meta
from moe.checkpoint.errors import CheckpointError
from moe.untrusted import open_regular, read_json

MAX_METADATA_BYTES = 256 << 20


def _fsync_file(f) -> None:
    f.flush()
    os.fsync(f.fileno())


class JsonStorageWriter(StorageWriter):
    """Writes this rank's chunks to `<dir>/data-<rank>.bin`; the coordinator writes
    `metadata.json` with `objects` (JSON-able non-tensor state) after every rank wrote."""

    def __init__(self, directory: str, objects: dict):
        super().__init__()
        self.directory, self.objects = directory, objects

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner) -> Future:
        name = f"data-{self.rank:05d}.bin"
        results, offset = [], 0
        with open(os.path.join(self.directory, name), "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise CheckpointError(f"{item.index.fqn}: non-tensor values go to JSON")
                t = planner.resolve_data(item).detach().to("cpu").contiguous().reshape(-1)
                data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
                f.write(data)
                chunk = meta.Chunk(
                    tuple(item.tensor_data.chunk.offsets),
                    tuple(item.tensor_data.chunk.sizes),
                    name,
                    offset,
                    len(data),
                    zlib.crc32(data),
                )
                results.append(WriteResult(item.index, len(data), chunk))
                offset += len(data)
            _fsync_file(f)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        chunks: dict[str, list] = {}
        for r in (r for rank_results in results for r in rank_results):
            chunks.setdefault(r.index.fqn, []).append(r.storage_data.to_json())
        tensors = {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{key}: non-tensor values go to JSON")
            tensors[key] = {
                "dtype": meta.dtype_name(md.properties.dtype),
                "shape": list(md.size),
                "chunks": chunks.get(key, []),
            }
        doc = {"format": meta.FORMAT, "version": meta.VERSION, "tensors": tensors}
        doc["objects"] = self.objects
        with open(os.path.join(self.directory, meta.METADATA), "w") as f:
            json.dump(doc, f)
            _fsync_file(f)


def read_metadata_json(directory: str) -> tuple[dict[str, meta.TensorEntry], dict]:
    """Read and validate `metadata.json` (every check of moe.checkpoint.metadata.parse)."""
    path = os.path.join(directory, meta.METADATA)
    raw = read_json(
        path, MAX_METADATA_BYTES, root=directory, error=CheckpointError, what="checkpoint metadata"
    )
    return meta.parse(raw, directory)


class JsonStorageReader(StorageReader):
    """Reads what JsonStorageWriter wrote; every chunk is CRC-checked before use."""

    def __init__(self, directory: str, tensors: dict[str, meta.TensorEntry]):
        super().__init__()
        self.directory, self.tensors = directory, tensors
        self.storage = {
            MetadataIndex(key, c.offsets): c for key, e in tensors.items() for c in e.chunks
        }

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = {
            key: TensorStorageMetadata(
                TensorProperties(dtype=e.dtype),
                torch.Size(e.shape),
                [
                    ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                    for c in e.chunks
                ],
            )
            for key, e in self.tensors.items()
        }
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for req in plan.items:
            if req.type != LoadItemType.TENSOR:
                raise CheckpointError(f"{req.storage_index.fqn}: refusing a non-tensor item")
            by_file.setdefault(self.storage[req.storage_index].file, []).append(req)
        for name, reqs in by_file.items():
            path = meta.resolve_file(self.directory, name, f"tensor {reqs[0].storage_index.fqn!r}")
            with open_regular(path, root=self.directory, error=CheckpointError) as f:
                for req in reqs:
                    self._read_one(f, path, req, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_one(self, f, path: str, req, planner) -> None:
        key, chunk = req.storage_index.fqn, self.storage[req.storage_index]
        dtype = self.tensors[key].dtype
        f.seek(chunk.offset)
        data = f.read(chunk.length)
        if len(data) != chunk.length:
            raise CheckpointError(f"{path}: truncated (tensor {key!r} ends past the file's end)")
        if zlib.crc32(data) != chunk.crc32:
            raise CheckpointError(
                f"{path}: checksum mismatch in the bytes of tensor {key!r} (the file is damaged)"
            )
        if data:
            t = torch.frombuffer(bytearray(data), dtype=dtype).reshape(chunk.sizes)
        else:
            t = torch.empty(chunk.sizes, dtype=dtype)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            t = t.narrow(dim, start, length)
        target = planner.resolve_tensor(req).detach()
        target.copy_(t)
        planner.commit_tensor(req, target)
