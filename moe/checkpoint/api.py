"""save_checkpoint / load_checkpoint on torch.distributed.checkpoint, atomic and pickle-free.

Layout of `path/`:
    LATEST                       name of the current complete checkpoint (replaced atomically)
    ckpt-<id>/metadata.json      JSON metadata (moe.checkpoint.metadata)
    ckpt-<id>/data-<rank>.bin    raw bytes of the chunks that rank owns (no gather to one rank)
    .moe-save.lock               held (flock) by the one save in progress (moe.checkpoint.folder)
Every rank writes into `path/.tmp-<id>/` (<id> from os.urandom); when DCP has finished on every
rank (metadata written last, by the coordinator), rank 0 renames the directory to `ckpt-<id>`,
replaces LATEST, and removes the checkpoint LATEST named before, so a save killed at any point
leaves the previous checkpoint loadable. Nothing else in `path` is ever removed.

Checkpoints of the older `manifest.json` format (moe-checkpoint v1) are refused with a
CheckpointError saying so (no legacy reader): load them with the release that wrote them and
save again with this one.
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from moe.checkpoint import slots as slot_files
from moe.checkpoint import state as st
from moe.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from moe.checkpoint.folder import MARKER, FolderLock, make_staging, new_id, remove_stale_staging
from moe.checkpoint.metadata import LAYOUT, METADATA, parse_layout
from moe.checkpoint.parts import as_model, is_partial, layout_note, layout_of, merge_objects
from moe.checkpoint.parts import unclaimed as unclaimed_names
from moe.checkpoint.storage import (
    MAX_METADATA_BYTES,
    JsonStorageReader,
    JsonStorageWriter,
    read_metadata_json,
)
from moe.checkpoint.validate import check_objects
from moe.comm.consistency import all_gather_records, raise_if_any_rank_failed
from moe.untrusted import UntrustedFileError, read_bytes

LATEST = "LATEST"
REFUSED = "checkpoint refused (nothing was changed)"
STAGING = ".tmp-"
_NAME = re.compile(r"ckpt-[0-9a-f]{1,32}")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _agree(problems: list[str], cls: type = CheckpointError, cause=None, values=None) -> None:
    """Raise the same CheckpointError on every rank if any rank found a problem (the local
    exception, if any, as its cause) or the ranks' `values` differ."""
    try:
        raise_if_any_rank_failed(problems, error=cls, what=REFUSED, values=values)
    except cls as e:
        raise e from cause


def _dcp_failure(e: CheckpointException) -> CheckpointError:
    """DCP's exception (every rank's traceback, the cause at its very end) as one line per
    failing rank: the file and what is wrong with it first."""
    lines = []
    for rank, (exc, _) in sorted(e.failures.items()):
        text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        lines.append(text if len(e.failures) == 1 and not _dist() else f"rank {rank}: {text}")
    return CheckpointError(f"{REFUSED}: " + "\n  ".join(lines))


def _identity(directory: str) -> dict:
    """What every rank must have read (issue 41 item 5): the checkpoint's name and a digest
    of its metadata (every tensor's shape and CRCs, the step in `extra`, the slot layouts)."""
    name = os.path.basename(os.path.normpath(directory))
    try:
        raw = read_bytes(os.path.join(directory, METADATA), MAX_METADATA_BYTES, root=directory)
    except (UntrustedFileError, OSError) as e:  # replaced since: differs from every other rank
        return {"checkpoint": name, "metadata sha256": f"unreadable ({e})"[:80]}
    return {"checkpoint": name, "metadata sha256": hashlib.sha256(raw).hexdigest()[:32]}


def fsync_dir(path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(path: str, tmp: str, final: str) -> None:
    """Publish `tmp` as `final` and point LATEST at it; then remove the checkpoint LATEST
    named before (a save's own entry) and staging directories of killed saves. Nothing else
    in `path` is touched. Called on rank 0 with the folder's lock held."""
    previous = _latest_name(path)
    os.remove(os.path.join(tmp, MARKER))
    fsync_dir(tmp)
    os.rename(tmp, final)
    pointer = os.path.join(path, LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(os.path.basename(final))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(path, LATEST))
    fsync_dir(path)
    old = os.path.join(path, previous) if previous else None
    if old and old != final and os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    remove_stale_staging(path, STAGING)


def _latest_name(path: str) -> str | None:
    """The checkpoint directory LATEST names, if it is a well-formed name (else None)."""
    try:
        name = read_bytes(os.path.join(path, LATEST), 100, root=path).decode("ascii").strip()
    except (UntrustedFileError, UnicodeDecodeError):
        return None
    return name if _NAME.fullmatch(name) else None


def _begin(path: str) -> tuple[FolderLock | None, str]:
    """Rank 0 locks the folder and creates the staging directory; every rank learns the id
    (or rank 0's error) in one exchange, before anything else is written."""
    rank0 = not _dist() or dist.get_rank() == 0
    lock, ident, problem = None, "", ""
    if rank0:
        try:
            lock = FolderLock(path)
            lock.acquire()
            ident = new_id()
            make_staging(path, STAGING, ident)
        except (CheckpointError, OSError) as e:
            if lock is not None and ident:  # a staging directory begun on a full disk
                shutil.rmtree(os.path.join(path, f"{STAGING}{ident}"), ignore_errors=True)
            if lock is not None:
                lock.release()
            lock, problem = None, str(e)
    if _dist():
        first = all_gather_records({"id": ident, "problem": problem})[0]
        ident, problem = first["id"], first["problem"]
    if problem:
        raise CheckpointError(f"save_checkpoint: {problem}")
    os.makedirs(os.path.join(path, f"{STAGING}{ident}"), exist_ok=True)  # other nodes
    return lock, str(ident)


def save_checkpoint(
    path: str,
    model: nn.Module,
    opt=None,
    *,
    extra: dict | None = None,
    trainable_only: bool = False,
) -> str:
    """Save `model` and optimizer `opt` (torch optimizer or GroupedApply) under `path`.
    Collective: every rank calls it and writes only its own shards. `model` may be a
    moe.pipeline.Pipeline (`opt` over its parameters): every rank of every stage saves its
    stages' part, in the format of the whole model (moe.checkpoint.parts). `extra` is the caller's
    metadata (e.g. the step, a training loop's state): a JSON object (finite numbers),
    published atomically with the tensors and returned by load_checkpoint. Returns the
    directory of the new checkpoint. Only the save's own entries in `path` are written or
    removed; a concurrent save into the same folder is a CheckpointError.
    trainable_only: save only the parameters that train (requires_grad; e.g. moe.lora's
    adapters) and their optimizer state: small files; load_checkpoint then loads those alone
    into a model whose frozen part was loaded elsewhere, and refuses a model whose frozen
    part is another base (a fingerprint of it is saved: moe.checkpoint.base)."""
    if not isinstance(trainable_only, bool):
        raise ValueError(f"save_checkpoint: trainable_only must be a bool, got {trainable_only!r}")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(
            f"save_checkpoint: extra must be a dict (a JSON object), got {type(extra)}"
        )
    model = as_model(model)
    tensors, objects, problem = {}, None, None
    try:
        tensors, objects = st.collect(model, opt, trainable_only)
        try:
            objects["extra"] = json.loads(json.dumps(extra or {}, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"save_checkpoint: extra must be JSON-serialisable: {e}") from e
    except Exception as e:  # noqa: BLE001 - a model in parts: every rank learns of it below
        if not is_partial(model):
            raise
        problem = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    if is_partial(model):  # every stage's MoE settings and optimizer groups, or one error
        objects = merge_objects(objects, problem)
    lock, ident = _begin(path)
    tmp, final = os.path.join(path, f"{STAGING}{ident}"), os.path.join(path, f"ckpt-{ident}")
    try:
        try:
            with warnings.catch_warnings():  # "assuming ... a single process": intended
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.save(
                    tensors, storage_writer=JsonStorageWriter(tmp, objects), no_dist=not _dist()
                )
        except CheckpointException as e:  # every rank raises it, after every rank wrote
            raise _write_failure(e, path) from e
        failed = torch.zeros(1, dtype=torch.int64)
        error = None
        if lock is not None:
            try:
                _commit(path, tmp, final)
            except OSError as e:
                failed += 1
                error = e
        if _dist():
            failed = failed.to(_device())
            dist.all_reduce(failed)
        if int(failed.item()):
            raise CheckpointError(
                f"save_checkpoint: publishing {final} failed on rank 0 ({_os_reason(error)}); "
                f"{_kept(path)}"
            ) from error
    except BaseException:
        if lock is not None:  # rank 0: nothing of this save is left behind
            _discard(path, tmp, final)
        raise
    finally:
        if lock is not None:
            lock.release()
    return final


def _os_reason(e) -> str:
    """'no space left on device (errno 28: ENOSPC)' for an OSError, else its text."""
    if isinstance(e, OSError) and e.errno:
        name = errno.errorcode.get(e.errno, str(e.errno))
        return f"{(e.strerror or name).lower()} (errno {e.errno}: {name})"
    return f"{type(e).__name__}: {e}"


def _kept(path: str) -> str:
    previous = _latest_name(path)
    kept = (
        f"the previous checkpoint {previous} is intact"
        if previous
        else f"{path} held no earlier checkpoint"
    )
    return f"nothing of this save was kept; {kept}"


def _write_failure(e: CheckpointException, path: str) -> CheckpointError:
    """DCP's failure of the write (an OSError on a rank: a full disk, a quota, EIO) as one line
    naming the rank and the reason; any other failure as _dcp_failure's lines."""
    oserrors = {r: exc for r, (exc, _) in e.failures.items() if isinstance(exc, OSError)}
    if not oserrors:
        return _dcp_failure(e)
    where = ", ".join(f"rank {r}" for r in sorted(oserrors)) if _dist() else "this process"
    reason = _os_reason(next(iter(oserrors.values())))
    return CheckpointError(
        f"save_checkpoint: writing into {path} failed on {where}: {reason}; {_kept(path)}"
    )


def _discard(path: str, tmp: str, final: str) -> None:
    """Remove what a failed save wrote: its staging directory, its LATEST.tmp, and its
    published directory unless LATEST already names it. Never raises."""
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.remove(os.path.join(path, LATEST + ".tmp"))
    if _latest_name(path) != os.path.basename(final):
        shutil.rmtree(final, ignore_errors=True)


def _add_layout_note(model: nn.Module, objects: dict, problems: list) -> None:
    """A refused load of (or into) a model in parts also names both layouts."""
    saved = parse_layout(objects.get(LAYOUT))
    if problems and (is_partial(model) or (saved and saved["pp"] > 1)):
        problems.insert(0, layout_note(saved, layout_of(model)))  # first: never cut off


def checkpoint_dir(path: str) -> str:
    """The directory of the current complete checkpoint under `path` (or `path` itself)."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    if os.path.isfile(os.path.join(path, "manifest.json")):
        raise CheckpointError(
            f"{path} is an old moe-checkpoint v1 (manifest.json) checkpoint, which this "
            "version does not read: load it with the release that wrote it and save again"
        )
    pointer = os.path.join(path, LATEST)
    if not os.path.lexists(pointer):
        raise CheckpointNotFoundError(f"no complete checkpoint under {path!r} (no {LATEST} file)")
    data = read_bytes(pointer, 100, root=path, error=CheckpointError, what="checkpoint pointer")
    name = data.decode("utf-8", errors="replace").strip()
    if not _NAME.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name!r:.80}, not a checkpoint directory")
    directory = os.path.join(path, name)
    root, real = os.path.realpath(path), os.path.realpath(directory)
    if os.path.dirname(real) != root or not os.path.isdir(real):
        raise CheckpointError(f"{pointer}: {name!r} is not a directory inside {path!r}")
    if os.path.isfile(os.path.join(real, "manifest.json")):
        return checkpoint_dir(directory)  # raises: the old format
    return directory


def load_checkpoint(
    path: str,
    model: nn.Module,
    opt=None,
    *,
    allow_config_change: bool = False,
    check_extra: Callable[[dict], None] | None = None,
) -> dict:
    """Load the checkpoint under `path` into `model` and `opt` at any layout (a Pipeline too,
    any (pp, dp, ep): see save_checkpoint). Collective.
    Validates everything first (tensors, optimizer hyper-parameters and state, and the MoE
    settings each layer was saved with, and for an adapters-only checkpoint the frozen base
    it was trained on: a difference is an error unless `allow_config_change`); any problem
    raises CheckpointError (a ValueError) naming it on
    every rank and changes nothing. Returns the `extra` saved with it (a JSON object, read
    without pickle). `check_extra(extra)` validates the caller's own metadata in that first
    phase: an exception it raises refuses the checkpoint the same way, on every rank (a
    ValueError's or TypeError's text as is, another's with its type's name)."""
    model = as_model(model)
    problems: list[str] = []
    stored, objects, loaded, claims = {}, {}, {}, {}
    cls, cause = CheckpointError, None
    try:
        directory = checkpoint_dir(path)
        stored, objects = read_metadata_json(directory)
        check_objects(objects)
        if check_extra is not None:
            try:
                check_extra(objects.get("extra", {}))
            except Exception as e:  # noqa: BLE001 - whatever it raises refuses on every rank
                why = (
                    str(e) if isinstance(e, TypeError | ValueError) else f"{type(e).__name__}: {e}"
                )
                raise CheckpointError(f"extra: {why}") from e
        loaded = st.targets(model, opt, stored, objects, problems, allow_config_change)
        claims = st.claims(model, opt, stored) if is_partial(model) else {}
        _add_layout_note(model, objects, problems)
    except CheckpointError as e:
        problems.append(str(e))
        cls, cause = type(e), e
    except Exception as e:  # noqa: BLE001 - a failure on one rank must not leave the others waiting
        problems.append(f"{type(e).__name__}: {e}")
        cause = e
    _agree(problems, cls, cause, _identity(directory) if not problems else None)
    if is_partial(model):  # the same metadata on every rank: what no rank holds
        problems = unclaimed_names(stored, objects, claims, has_opt=opt is not None)
        _add_layout_note(model, objects, problems)
        if problems:
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CheckpointError(f"{REFUSED}:\n  " + "\n  ".join(problems[:20]) + more)
    try:
        reader = JsonStorageReader(directory, stored)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(loaded, storage_reader=reader, no_dist=not _dist())
    except CheckpointException as e:
        raise _dcp_failure(e) from e
    problems = []  # read, not applied: the stored placements checked and agreed first
    slot_files.check_loaded(model, loaded, problems)
    _agree(problems)
    st.apply(model, opt, loaded, objects)
    return objects.get("extra", {})
