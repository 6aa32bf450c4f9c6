"""Checkpoints of a model that each rank holds only in part (pipeline stages), in the format of
a whole model's, so a checkpoint written at any (pp, dp, ep) loads at any other.

A rank's parts are checkpointed as one module, ModelParts, whose children are the parts'
children under their names in the whole model: torch's state-dict helpers (get_/set_model_
state_dict, get_/set_optimizer_state_dict) then give the single-process keys and global shapes,
with one optimizer over all of this rank's parts, and DCP writes and reads each stage's keys
from that stage's ranks (every rank of every stage takes part in one dcp.save / dcp.load).

What only the whole model knows is settled across the world: at save, the JSON objects every
rank would write (MoE layer settings, replica layouts, optimizer hyper-parameters and
non-tensor state) are merged, so the checkpoint describes every stage; at load, each rank
checks the keys it holds, and one all-reduce of which stored names some rank claims finds
what no stage holds (another model), before any tensor is read.

The metadata records the layout it was saved at ({"pp", "dp", "ep"}, moe.checkpoint.metadata
.parse_layout): a load at another layout is allowed; a refusal names both layouts.
"""

import json

import torch
import torch.distributed as dist
from torch import nn

from moe.checkpoint.errors import CheckpointError
from moe.comm.consistency import all_gather_records
from moe.layer import moe_layers


class ModelParts(nn.Module):
    """`parts` (modules whose children are children of one whole model, under its names) as
    one module holding those children; `layout`: {"pp", "dp", "ep"} of the run."""

    def __init__(self, parts: list[nn.Module], layout: dict[str, int]):
        super().__init__()
        for part in parts:
            own = [*part.parameters(recurse=False), *part.buffers(recurse=False)]
            if own:
                raise ValueError(
                    f"a model part ({type(part).__name__}) holds parameters or buffers of its "
                    "own; only its children are checkpointed under their whole-model names"
                )
            for name, child in part.named_children():
                if name in self._modules:
                    raise ValueError(f"model parts: {name!r} is in two parts")
                self.add_module(name, child)
        self.layout = dict(layout)


def as_model(model) -> nn.Module:
    """`model` itself, or the ModelParts of an object with checkpoint_module() (a Pipeline)."""
    if isinstance(model, nn.Module):
        return model
    make = getattr(model, "checkpoint_module", None)
    parts = make() if callable(make) else None
    if not isinstance(parts, nn.Module):
        raise ValueError(
            f"model must be an nn.Module or a moe.pipeline.Pipeline, got {type(model).__name__}"
        )
    return parts


def is_partial(model: nn.Module) -> bool:
    return isinstance(model, ModelParts)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def layout_of(model: nn.Module) -> dict[str, int]:
    """(pp, dp, ep) of the run holding `model`: a ModelParts' own; else pp = 1, ep the MoE
    layers' expert-parallel size (experts over local experts) and dp the rest of the world."""
    if is_partial(model):
        return dict(model.layout)
    world = dist.get_world_size() if _dist() else 1
    sizes = [layer.num_slots // layer.experts.num_experts for _, layer in moe_layers(model)]
    ep = max(sizes, default=1)
    ep = ep if ep >= 1 and world % ep == 0 else 1
    return {"pp": 1, "dp": world // ep, "ep": ep}


def layout_note(saved, live: dict[str, int]) -> str:
    """A refusal's last line: the two layouts, and that only the layout may differ."""

    def text(layout) -> str:
        return "(pp, dp, ep) = ({pp}, {dp}, {ep})".format(**layout)

    where = text(saved) if saved else "an unrecorded layout"
    return (
        f"the checkpoint was saved at {where}, this run is at {text(live)}: the layout may "
        "differ, the model and its settings may not"
    )


# -- save: one description of the whole model --------------------------------------------


def _union(per_rank: list, key: str, problems: list) -> dict:
    out: dict = {}
    for objects in per_rank:
        for name, value in (objects.get(key) or {}).items():
            if name in out and out[name] != value:
                problems.append(f"{key}[{name!r}] differs across ranks")
            out.setdefault(name, value)
    return out


def _optimizers(per_rank: list, problems: list):
    metas = [o.get("optimizer") for o in per_rank]
    if all(m is None for m in metas):
        return None
    if any(m is None for m in metas):
        problems.append("an optimizer was given on some ranks only")
        return None
    out = dict(metas[0])
    for m in metas[1:]:
        for key in ("class", "loss_scaler"):
            if m.get(key) != out.get(key):
                problems.append(f"optimizer {key} differs across ranks")
    out["state_values"] = _union(metas, "state_values", problems)
    groups: list[dict] = []
    for m in metas:
        for i, g in enumerate(m["param_groups"]):
            hyper = {k: v for k, v in g.items() if k != "params"}
            if i == len(groups):
                groups.append({**hyper, "params": []})
            elif {k: v for k, v in groups[i].items() if k != "params"} != hyper:
                problems.append(
                    f"optimizer param_groups[{i}]: hyper-parameters differ across stages "
                    "(a checkpoint holds one value per group)"
                )
            groups[i]["params"] += [p for p in g["params"] if p not in groups[i]["params"]]
    out["param_groups"] = groups
    return out


def merge_objects(objects: dict | None, problem: str | None) -> dict:
    """Every rank's objects merged (MoE layers, replica layouts, the frozen base's fingerprint
    and optimizer state of every stage; the rest rank 0's), or the same CheckpointError on
    every rank naming each rank's
    `problem`. Collective over the world: every rank calls it, also one that failed."""
    record = {"objects": "" if problem else json.dumps(objects), "problem": problem or ""}
    records = all_gather_records(record) if _dist() else [record]
    failed = [f"rank {r}: {rec['problem']}" for r, rec in enumerate(records) if rec["problem"]]
    if failed:
        raise CheckpointError("save_checkpoint: " + "; ".join(failed) + " (nothing was written)")
    per_rank = [json.loads(rec["objects"]) for rec in records]
    problems: list[str] = []
    out = dict(per_rank[0])
    for key in ("moe_layers", "slot_layouts", "base"):
        out[key] = _union(per_rank, key, problems)
    out["optimizer"] = _optimizers(per_rank, problems)
    if problems:
        raise CheckpointError("save_checkpoint: " + "; ".join(problems) + " (nothing was written)")
    return out


# -- load: what no stage holds ------------------------------------------------------------


def unclaimed(stored: dict, objects: dict, claims: dict[str, set], has_opt: bool) -> list[str]:
    """Problems naming the stored names no rank holds: `claims` are this rank's ("tensors":
    stored keys, "layers": MoE layer names, "states": parameters its optimizer manages).
    One all-reduce over the world of a 0/1 per stored name; the same list on every rank (the
    metadata was agreed before)."""
    opt_meta = objects.get("optimizer") if isinstance(objects.get("optimizer"), dict) else {}
    names = {  # layers first: a refusal's first lines say which part of the model differs
        "layers": sorted(objects.get("moe_layers") or {}),
        "tensors": sorted(stored),
        "states": sorted(opt_meta.get("state_values") or {}),
    }
    flags = [float(has_opt)]
    for kind, keys in names.items():
        flags += [float(k in claims[kind]) for k in keys]
    held = torch.tensor(flags, dtype=torch.float64)
    if _dist():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        held = held.to(device)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        held = held.cpu()
    any_opt, rest = bool(held[0] > 0), held[1:].tolist()
    problems, i = [], 0
    for kind, keys in names.items():
        for k in keys:
            if not rest[i]:
                if kind == "layers":
                    problems.append(f"MoE layer {k!r}: in the checkpoint but not in the model")
                elif kind == "tensors" and k.startswith("model/"):
                    problems.append(f"{k}: in the checkpoint but not in the model")
                elif kind == "tensors" and any_opt:
                    problems.append(f"{k}: in the checkpoint but not a parameter of any optimizer")
                elif any_opt:
                    problems.append(f"optimizer state of {k!r}: not a parameter of any optimizer")
            i += 1
    return problems
