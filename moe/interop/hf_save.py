"""save_hf_checkpoint: a from_hf-converted model in the hub layout transformers' from_pretrained
loads (config.json, per-rank shards, index), each rank writing its experts, into a staging
directory inside the folder; the new index, replaced last, publishes the save. Only files of
the previous save (named in its own index) are removed; other files (tokenizer, README) are
left alone.

The table's families are written per expert under their hub names (hf_checkpoint._pieces, what
load_hf_checkpoint reads). A layer converted through transformers' experts contract
(HFExpertsLayer) is written under its experts module's own names, read from the module it
replaced (`<path>.gate_up_proj`, `<path>.down_proj`, their biases, a post-expert norm's weight):
its weights in canonical expert order put into a copy of that module in the module's own
layout (hf_contract.write_back: transposed or not, gate / up concatenated or interleaved), its
whole stacks gathered on every rank (a collective) and written by rank 0.
"""

import copy
import json
import os
import re
import shutil

import torch
from torch import nn

from moe.checkpoint.api import fsync_dir
from moe.checkpoint.folder import FolderLock, make_staging, new_id, remove_stale_staging
from moe.comm.consistency import all_gather_records
from moe.interop.hf import HFMoELayer
from moe.interop.hf_checkpoint import _gathered, _layers, _pieces, _world
from moe.interop.hf_contract import HFExpertsLayer, write_back
from moe.interop.hf_files import INDEX, SINGLE, HFCheckpointError, read_index

SAVED_BY = "moe.save_hf_checkpoint"  # in the index's metadata: this folder's shards are ours
STAGING = ".moe-hf-"
_SHARD = re.compile(r"model-[0-9a-f]{16}-\d{5}-of-\d{5}\.safetensors")
_OTHER_WEIGHTS = (SINGLE, "pytorch_model.bin", "pytorch_model.bin.index.json")


def _holders(model: nn.Module) -> bool:
    """Whether this rank writes its experts: the lowest rank holding each expert range."""
    rank, world = _world()
    layout = {
        n: m.experts.expert_offset for n, m in model.named_modules() if isinstance(m, HFMoELayer)
    }
    if world == 1:
        return True
    records = all_gather_records({"layout": json.dumps(layout, sort_keys=True)})
    return all(r["layout"] != records[rank]["layout"] for r in records[:rank])


def _previous_shards(path: str) -> list[str]:
    """Shard files of the previous save_hf_checkpoint into `path` (named in its own index),
    to remove once the new save is published. Weight files it did not write are an error:
    they would shadow or mix with the new weights, and they are not this save's to delete."""
    foreign = [n for n in _OTHER_WEIGHTS if os.path.lexists(os.path.join(path, n))]
    previous = []
    if os.path.lexists(os.path.join(path, INDEX)):
        doc = read_index(path)
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(meta, dict) or meta.get("saved_by") != SAVED_BY:
            foreign.append(INDEX)
        elif isinstance(weight_map, dict):
            names = {v for v in weight_map.values() if isinstance(v, str)}
            previous = sorted(n for n in names if _SHARD.fullmatch(n))
    if foreign:
        raise HFCheckpointError(
            f"{path} holds {sorted(foreign)}, which save_hf_checkpoint did not write: remove "
            "them or save into another folder (nothing was written)"
        )
    return previous


def _begin(path: str, world: int) -> tuple[FolderLock | None, str, list[str]]:
    """Rank 0 locks the folder, finds the previous save's shards and creates the staging
    directory; every rank learns the id or rank 0's error in one exchange."""
    lock, ident, problem, previous = None, "", "", []
    if _world()[0] == 0:
        try:
            lock = FolderLock(path)
            lock.acquire()
            previous = _previous_shards(path)
            ident = new_id()
            make_staging(path, STAGING, ident)
        except (ValueError, OSError) as e:  # CheckpointError and HFCheckpointError included
            if lock is not None:
                lock.release()
            lock, problem = None, str(e)
    if world > 1:
        first = all_gather_records({"id": ident, "problem": problem})[0]
        ident, problem = first["id"], first["problem"]
    if problem:
        raise HFCheckpointError(f"save_hf_checkpoint: {problem}")
    return lock, str(ident), previous


def _publish(model: nn.Module, path: str, staging: str, everyone: list, previous: list) -> None:
    """Rank 0: move the new shards and config.json into `path`, replace the index (the commit
    point: until then the previous save stays whole), then delete the previous save's shards
    and the staging directory. Other files in `path` are left alone."""
    weight_map = {k: v for r in everyone for k, v in r.items()}
    doc = {"metadata": {"saved_by": SAVED_BY}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(staging, INDEX), "w") as f:
        json.dump(doc, f)
    model.config.to_json_file(os.path.join(staging, "config.json"))
    fsync_dir(staging)
    for name in sorted(set(weight_map.values())):  # fresh names: nothing is overwritten
        os.replace(os.path.join(staging, name), os.path.join(path, name))
    os.replace(os.path.join(staging, "config.json"), os.path.join(path, "config.json"))
    fsync_dir(path)
    os.replace(os.path.join(staging, INDEX), os.path.join(path, INDEX))
    fsync_dir(path)
    for name in set(previous) - set(weight_map.values()):
        old = os.path.join(path, name)
        if os.path.isfile(old) and not os.path.islink(old):
            os.remove(old)
    shutil.rmtree(staging, ignore_errors=True)
    remove_stale_staging(path, STAGING)


@torch.no_grad()
def save_hf_checkpoint(model: nn.Module, path: str) -> str:
    """Write the model in the hub layout transformers loads (collective under EP) into the
    folder `path`: config.json, the index and this save's shards. Other files there
    (tokenizer, README) are left alone; the previous save's shards are replaced."""
    from safetensors.torch import save_file

    rank, world = _world()
    writes_experts = _holders(model)
    state = model.state_dict(keep_vars=True)
    tensors, blocks = {}, {}
    slots = {m.name: m.slot_of_expert_E.tolist() for m in _layers(model).values()}
    for p in _pieces(model, fused=False):  # every rank in the same order: gathers are collective
        if p.fused == "contract":  # written whole below
            continue
        if p.expert is not None:
            if p.name not in blocks:
                blocks[p.name] = _gathered(state[p.name], expert=True)
            layer = model.get_submodule(p.name.rsplit(".experts.", 1)[0])
            first, slot = layer.experts.expert_offset, slots[layer.name][p.expert]
            if first <= slot < first + layer.experts.num_experts and writes_experts:
                tensors[p.hub_key] = blocks[p.name][slot - first].t()  # canonical expert ids
            continue
        value = _gathered(state[p.name], expert=False)
        if rank == 0:
            tensors[p.hub_key] = value
    for name, layer in model.named_modules():  # the contract's layers: whole, on rank 0
        if isinstance(layer, HFExpertsLayer):
            own = _contract_tensors(name, layer)
            tensors.update(own if rank == 0 else {})
    lock, ident, previous = _begin(path, world)
    error = ""
    try:
        staging = os.path.join(path, f"{STAGING}{ident}")
        os.makedirs(staging, exist_ok=True)  # rank 0 made it; other nodes' view
        file = f"model-{ident}-{rank + 1:05d}-of-{world:05d}.safetensors"
        if tensors:
            cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
            save_file(cpu, os.path.join(staging, file), metadata={"format": "pt"})
        keys = {k: file for k in tensors}
        everyone = all_gather_records(keys) if world > 1 else [keys]
        if lock is not None:
            try:
                _publish(model, path, staging, everyone, previous)
            except OSError as e:
                error = f"save_hf_checkpoint: publishing into {path} failed on rank 0: {e}"
    finally:
        if lock is not None:
            lock.release()
    if world > 1:
        error = all_gather_records({"error": error})[0]["error"]
    if error:
        raise OSError(error)
    return path


def _contract_tensors(path: str, layer: HFExpertsLayer) -> dict[str, torch.Tensor]:
    """hub key -> tensor for a contract layer: the replaced experts module's own state-dict
    names; its 3-D weights (and biases) from the layer's whole stacks in canonical expert
    order, written into a copy of the module in its own layout; its other tensors (a
    post-expert norm the layer computes with) the layer's, which has them under the same names.
    Every rank calls it (DTensor stacks are gathered)."""
    template = layer.hf_template[0]
    state = layer.state_dict(keep_vars=True)
    slot_E = layer.slot_of_expert_E
    whole = {}
    for n in ("w1", "w2", "w3", "b1", "b2", "b3"):
        t = getattr(layer.experts, n, None)
        t = None if t is None else _gathered(t, expert=False)
        if t is not None and t.shape[0] != layer.num_slots:
            raise HFCheckpointError(
                f"save_hf_checkpoint: {path}.experts.{n} holds {t.shape[0]} of "
                f"{layer.num_slots} expert slots and is not a DTensor to gather"
            )
        whole[n] = None if t is None else t[slot_E.to(t.device)]
    ref = whole["w2"]
    module = copy.deepcopy(template).to_empty(device=ref.device).to(ref.dtype)
    write_back(module, whole)
    own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
    return {
        f"{path}.{n}": own[n].detach() if n in own else _gathered(state[n], expert=False)
        for n in template.state_dict()
    }
