"""Router replay: record the experts every MoE layer chose per token, force them later.

    with moe.record_routing(model) as routes:
        model(x)                                  # one record per forward, per layer
    routes.save("routes-{rank}.safetensors")      # "{rank}": this rank's number (EP: one file each)
    with moe.replay_routing(model, moe.Routes.load("routes-{rank}.safetensors")):
        loss = model(x).sum()                     # same experts; gradients reach the router
    loss.backward()

Several forwards: recording appends one record per forward to each layer's list, in order;
replay gives forward i of a layer record i of that layer (a forward past the last record is an
error). Every forward counts once, in call order, whether or not its output reaches a
backward (a dropped forward still takes its record, as recording recorded it). A forward
autograd runs again in backward (activation checkpointing) is neither recorded nor counted:
it replays the record its original forward took, whatever the order of forwards and
backwards (moe.recompute_frame). MoEConfig.checkpoint and moe.memory.recompute_blocks do this
themselves; your own torch.utils.checkpoint must pass use_reentrant=False,
context_fn=moe.recompute_context, else the recompute is a RuntimeError (never a wrong record).

Under replay the router still computes its scores; only the top-k choice is replaced. The
combine weights are the router's own scores at the recorded experts, normalised as the router
normalises them (so the router gets gradients through them, as in Megatron-Core's router
replay), or the recorded weights with `weights=True`. Aux losses are the router's usual ones,
computed from its scores and the replayed choice (noisy_topk's smooth load estimate keeps
its own noisy threshold). Capacity and drops follow the replayed choice: the dispatch plan is
built from it. GShard's declined second expert e is recorded as
~e = -1 - e and replayed as declined. Expert-choice routing has no per-token choice: an error.

Checks: layer names, k, dtypes and shapes, expert ids (range; prototype groups) are checked
when replay_routing is entered, before any layer changes (one host read of the ids there); a
token count that differs from the record is raised by that layer's forward before it routes.
Replay runs eagerly; under torch.compile it gave the recorded outputs in a quick check, but
the per-forward record lookup is Python state the compiler guards on (not tuned for it).
"""

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe.gating import Routing
from moe.gating.balance import in_recomputation
from moe.layer import MoELayer, moe_layers
from moe.recompute_frame import in_frame_recompute, once_per_forward

FORMAT = "moe.routes/1"
WEIGHT_DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16}


@dataclass
class RouteRecord:
    """One forward of one layer: expert_ids_TK long [T, K] (~e < 0: expert e, declined)
    and weights_TK float [T, K], the combine weights (before capacity drops)."""

    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor


class Routes:
    """Recorded routing: per MoE layer (qualified name, model order), one record per forward."""

    def __init__(self, layers: dict[str, list[RouteRecord]] | None = None):
        self.layers: dict[str, list[RouteRecord]] = layers if layers is not None else {}

    def __getitem__(self, name: str) -> list[RouteRecord]:
        return self.layers[name]

    def __repr__(self) -> str:
        calls = {name: len(records) for name, records in self.layers.items()}
        return f"Routes({calls})"

    def save(self, path: str | Path) -> Path:
        """Write a safetensors file (no pickle); "{rank}" in `path` becomes this rank."""
        from safetensors.torch import save_file

        path = rank_path(path)
        tensors = {}
        for name, records in self.layers.items():
            for i, r in enumerate(records):
                tensors[f"{name}/{i}/expert_ids_TK"] = r.expert_ids_TK.to("cpu", torch.int64)
                tensors[f"{name}/{i}/weights_TK"] = r.weights_TK.cpu()
        layers = json.dumps({name: len(records) for name, records in self.layers.items()})
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            path,
            metadata={"format": FORMAT, "layers": layers},
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Routes":
        """Read a file written by `save`, checking names, dtypes and shapes before loading."""
        from safetensors import safe_open

        path = rank_path(path)
        with safe_open(str(path), framework="pt") as f:
            counts = _layer_counts(path, f.metadata() or {})
            keys = set(f.keys())
            if 2 * sum(counts.values()) != len(keys):  # before building any name from counts
                raise ValueError(
                    f"{path}: the layer list names {2 * sum(counts.values())} tensors, the file "
                    f"holds {len(keys)}"
                )
            expected = {
                f"{name}/{i}/{part}"
                for name, n in counts.items()
                for i in range(n)
                for part in ("expert_ids_TK", "weights_TK")
            }
            if keys != expected:
                odd = sorted(keys ^ expected)[0]
                state = "missing" if odd in expected else "unexpected"
                raise ValueError(f"{path}: tensor {odd!r} is {state}")
            layers = {}
            for name, n in counts.items():
                layers[name] = [_load_record(f, path, name, i) for i in range(n)]
        return cls(layers)


def rank_path(path: str | Path) -> Path:
    """`path` with "{rank}" replaced by this process's rank (0 without torch.distributed)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return Path(str(path).replace("{rank}", str(rank)))


def _layer_counts(path: Path, metadata: dict) -> dict[str, int]:
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not a routes file (format {metadata.get('format')!r})")
    try:
        counts = json.loads(metadata.get("layers", ""))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: unreadable layer list ({e})") from None
    if not isinstance(counts, dict) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()
    ):
        raise ValueError(f"{path}: the layer list must map layer names to record counts")
    return counts


def _load_record(f, path: Path, name: str, i: int) -> RouteRecord:
    ids, weights = f.get_slice(f"{name}/{i}/expert_ids_TK"), f.get_slice(f"{name}/{i}/weights_TK")
    where = f"{path}: layer {name!r}, forward {i}"
    if ids.get_dtype() != "I64" or len(ids.get_shape()) != 2:
        raise ValueError(f"{where}: expert_ids_TK must be int64 [T, K], got {ids.get_dtype()} ")
    if weights.get_dtype() not in WEIGHT_DTYPES or weights.get_shape() != ids.get_shape():
        raise ValueError(
            f"{where}: weights_TK must be float {ids.get_shape()}, got "
            f"{weights.get_dtype()} {weights.get_shape()}"
        )
    return RouteRecord(ids[:], weights[:])


class _Recorder:
    """A layer's route_recorder: appends each (not recomputed) forward's choice."""

    def __init__(self, records: list[RouteRecord]):
        self.records = records

    def add(self, routing: Routing) -> None:
        ids_TK = routing.expert_ids_TK.detach()
        if routing.mask_TK is not None:  # a declined pair (expert e) is recorded as ~e < 0
            ids_TK = torch.where(routing.mask_TK, ids_TK, ~ids_TK)
        self.records.append(RouteRecord(ids_TK, routing.weights_TK.detach()))


class _Replay:
    """A layer's route_replay: original forward i gets record i; a recompute gets the record of
    the forward it repeats (moe.recompute_frame)."""

    def __init__(self, name: str, records: list[RouteRecord], weights: bool):
        self.name, self.records, self.weights = name, records, weights
        self.next = 0

    def __repr__(self) -> str:
        return f"router replay of {self.name}"

    def _take_next(self) -> int:
        index = self.next
        if index >= len(self.records):
            raise ValueError(
                f"{self.name}: routes hold {len(self.records)} forward(s) of this layer; "
                f"forward {index + 1} has no record to replay"
            )
        self.next += 1
        return index

    def route(self, layer: MoELayer, x_TD: torch.Tensor) -> Routing:
        if in_recomputation() and not in_frame_recompute():
            raise RuntimeError(
                f"{self.name}: a forward run again in backward without moe.recompute_context: "
                "router replay cannot tell which forward it repeats; checkpoint with "
                "use_reentrant=False, context_fn=moe.recompute_context"
            )
        index = once_per_forward(self, self._take_next)
        record = self.records[index]
        if record.expert_ids_TK.shape[0] != x_TD.shape[0]:
            raise ValueError(
                f"{self.name}: forward {index} was recorded with "
                f"{record.expert_ids_TK.shape[0]} tokens, got {x_TD.shape[0]}"
            )
        routing = layer.router(x_TD, forced_ids_TK=record.expert_ids_TK)
        if self.weights:
            routing.weights_TK = record.weights_TK.to(routing.weights_TK.dtype)
        return routing


def _layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers (moe.MoELayer) to record or replay")
    for name, layer in layers:
        if not layer.router.replayable:
            raise ValueError(
                f"{name}: router={layer.config.router!r} chooses tokens per expert, not "
                "experts per token: router replay is not supported"
            )
    return layers


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[Routes]:
    """Record every MoE layer's chosen experts and combine weights for each forward inside
    the block (one record per forward, in order). Records stay on the device (no host sync)."""
    layers = _layers(model)
    routes = Routes({name: [] for name, _ in layers})
    previous = [layer.route_recorder for _, layer in layers]
    for name, layer in layers:
        layer.route_recorder = _Recorder(routes.layers[name])
    try:
        yield routes
    finally:
        for (_, layer), recorder in zip(layers, previous):
            layer.route_recorder = recorder


@contextlib.contextmanager
def replay_routing(model: nn.Module, routes: Routes, weights: bool = False) -> Iterator[None]:
    """Force the recorded expert choice in every forward inside the block (train or eval).
    `weights=True` replays the recorded combine weights too (no gradient to the router
    through them). Every check runs before any layer changes: an error names the layer."""
    layers = _layers(model)
    names = [name for name, _ in layers]
    for name in names:
        if name not in routes.layers:
            raise ValueError(f"{name}: the routes have no records for this MoE layer")
    for name in routes.layers:
        if name not in names:
            raise ValueError(f"{name}: the routes name a layer the model does not have")
    replays = [
        _Replay(name, _checked(name, layer, routes.layers[name]), weights) for name, layer in layers
    ]
    previous = [layer.route_replay for _, layer in layers]
    for (_, layer), replay in zip(layers, replays):
        layer.route_replay = replay
    try:
        yield
    finally:
        for (_, layer), replay in zip(layers, previous):
            layer.route_replay = replay


def _checked(name: str, layer: MoELayer, records: list[RouteRecord]) -> list[RouteRecord]:
    """The records on the router's device, after checking them against the layer."""
    c, device = layer.config, layer.router.weight.device
    out = []
    for i, r in enumerate(records):
        ids_TK, weights_TK = r.expert_ids_TK, r.weights_TK
        where = f"{name}: forward {i}"
        if ids_TK.dtype != torch.int64 or ids_TK.dim() != 2:
            raise ValueError(f"{where}: expert ids must be int64 [T, K], got {ids_TK.dtype}")
        if ids_TK.shape[1] != c.top_k:
            raise ValueError(f"{where}: recorded k={ids_TK.shape[1]}, the layer has {c.top_k}")
        if weights_TK.shape != ids_TK.shape or not weights_TK.is_floating_point():
            raise ValueError(f"{where}: weights must be float {tuple(ids_TK.shape)}")
        problem = type(layer.router).forced_ids_problem(c, ids_TK)
        if problem is not None:
            raise ValueError(f"{where}: {problem} (num_experts={c.num_experts})")
        out.append(RouteRecord(ids_TK.to(device), weights_TK.to(device)))
    return out


__all__ = ["RouteRecord", "Routes", "record_routing", "replay_routing"]
