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
backwards (moe.recompute_frame). MoEConfig.recompute and moe.memory.recompute_blocks do this
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

Checks: layer names, k, dtypes and shapes, expert ids (range; prototype groups; no expert twice
in one token's row), finite weights and, under torch.distributed, the rank and world the
routes were recorded on (each rank replays its own file; one process may replay any rank's)
are checked when replay_routing is entered, before any layer changes (one host read of the
ids there); an error names the file the routes were read from. Routes.load reads the file as
untrusted (moe.trace.routes_file: a FIFO, a directory or a damaged header is a RoutesFileError
naming it). A token count that differs from the record is raised by that layer's forward
before it routes.
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

from moe.comm.consistency import all_gather_records
from moe.gating import Routing
from moe.gating.balance import in_recomputation
from moe.layer import MoELayer, moe_layers
from moe.recompute_frame import in_frame_recompute, once_per_forward
from moe.trace.routes_file import RoutesFileError, read_safetensors
from moe.untrusted import parse_json

FORMAT = "moe.routes/1"


@dataclass
class RouteRecord:
    """One forward of one layer: expert_ids_TK long [T, K] (~e < 0: expert e, declined)
    and weights_TK float [T, K], the combine weights (before capacity drops)."""

    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor


class Routes:
    """Recorded routing: per MoE layer (qualified name, model order), one record per forward.
    `rank`/`world`: where it was recorded (None: unknown); `source`: the file it was read
    from (None: recorded in this process), named by replay_routing's errors."""

    def __init__(
        self,
        layers: dict[str, list[RouteRecord]] | None = None,
        *,
        rank: int | None = None,
        world: int | None = None,
        source: Path | None = None,
    ):
        self.layers: dict[str, list[RouteRecord]] = layers if layers is not None else {}
        self.rank, self.world, self.source = rank, world, source

    def __getitem__(self, name: str) -> list[RouteRecord]:
        return self.layers[name]

    def __repr__(self) -> str:
        calls = {name: len(records) for name, records in self.layers.items()}
        return f"Routes({calls})"

    def save(self, path: str | Path) -> Path:
        """Write a safetensors file (no pickle); "{rank}" in `path` becomes this rank. The
        file notes the rank and world it was recorded on (replay on other ranks is refused)."""
        from safetensors.torch import save_file

        path = rank_path(path)
        tensors = {}
        for name, records in self.layers.items():
            for i, r in enumerate(records):
                tensors[f"{name}/{i}/expert_ids_TK"] = r.expert_ids_TK.to("cpu", torch.int64)
                tensors[f"{name}/{i}/weights_TK"] = r.weights_TK.cpu()
        metadata = {"format": FORMAT, "layers": json.dumps(
            {name: len(records) for name, records in self.layers.items()}
        )}  # fmt: skip
        if self.rank is not None:
            metadata.update(rank=str(self.rank), world=str(self.world))
        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Routes":
        """Read a file written by `save` (untrusted: moe.trace.routes_file), checking names, dtypes
        and shapes; every problem is a RoutesFileError naming the file."""
        path = rank_path(path)
        metadata, tensors = read_safetensors(path)
        where = f"routes file {str(path)!r}"
        counts = _layer_counts(where, metadata)
        if 2 * sum(counts.values()) != len(tensors):  # before building any name from counts
            raise RoutesFileError(
                f"{where}: the layer list names {2 * sum(counts.values())} tensors, the file "
                f"holds {len(tensors)}"
            )
        expected = {
            f"{name}/{i}/{part}"
            for name, n in counts.items()
            for i in range(n)
            for part in ("expert_ids_TK", "weights_TK")
        }
        if set(tensors) != expected:
            odd = sorted(set(tensors) ^ expected)[0]
            state = "missing" if odd in expected else "unexpected"
            raise RoutesFileError(f"{where}: tensor {odd!r:.200} is {state}")
        layers = {
            name: [_load_record(tensors, where, name, i) for i in range(n)]
            for name, n in counts.items()
        }
        rank, world = _rank_and_world(where, metadata)
        return cls(layers, rank=rank, world=world, source=path)


def rank_path(path: str | Path) -> Path:
    """`path` with "{rank}" replaced by this process's rank (0 without torch.distributed)."""
    return Path(str(path).replace("{rank}", str(_rank_and_world_now()[0])))


def _rank_and_world_now() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _layer_counts(where: str, metadata: dict) -> dict[str, int]:
    if metadata.get("format") != FORMAT:
        raise RoutesFileError(
            f"{where}: not a routes file (format {metadata.get('format')!r:.100})"
        )
    counts = parse_json(
        metadata.get("layers", "").encode(), f"{where}: layer list", error=RoutesFileError
    )
    if not isinstance(counts, dict) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()
    ):
        raise RoutesFileError(f"{where}: the layer list must map layer names to record counts")
    return counts


def _rank_and_world(where: str, metadata: dict) -> tuple[int | None, int | None]:
    """The rank and world noted in the file (None, None in files written before they were)."""
    if "rank" not in metadata and "world" not in metadata:
        return None, None
    rank, world = metadata.get("rank", ""), metadata.get("world", "")
    if not (
        rank.isdigit() and world.isdigit() and len(rank + world) < 20 and int(rank) < int(world)
    ):
        raise RoutesFileError(f"{where}: rank {rank!r:.20} of world {world!r:.20} is not valid")
    return int(rank), int(world)


def _load_record(tensors: dict, where: str, name: str, i: int) -> RouteRecord:
    ids, weights = tensors[f"{name}/{i}/expert_ids_TK"], tensors[f"{name}/{i}/weights_TK"]
    where = f"{where}: layer {name!r:.200}, forward {i}"
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise RoutesFileError(f"{where}: expert_ids_TK must be int64 [T, K], got {ids.dtype}")
    if not weights.is_floating_point() or weights.shape != ids.shape:
        raise RoutesFileError(
            f"{where}: weights_TK must be float {list(ids.shape)}, got "
            f"{weights.dtype} {list(weights.shape)}"
        )
    return RouteRecord(ids, weights)


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
        self.left = False  # set when the replay_routing block is left

    def __repr__(self) -> str:
        return f"router replay of {self.name}"

    def stale_reason(self) -> str | None:
        """Asked by moe.recompute_frame before a recompute of a forward this replay routed:
        after the block was left the layer would route afresh, not replay."""
        if not self.left:
            return None
        return (
            f"{self.name}: backward recomputes a forward that ran inside moe.replay_routing, "
            "but the block has been left, so the recompute cannot replay its routes: run "
            "backward inside the replay_routing block (or without recompute)"
        )

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
    rank, world = _rank_and_world_now()
    routes = Routes({name: [] for name, _ in layers}, rank=rank, world=world)
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
    through them). Every check runs before any layer changes: an error names the layer (and
    the routes file). Under torch.distributed every rank enters it (one all-gather of the
    outcome): a problem on one rank is the same ValueError on every rank."""
    layers = _layers(model)
    try:
        replays, problem = _prepared(layers, routes, weights), None
    except ValueError as e:
        replays, problem = [], str(e)
    if _rank_and_world_now()[1] > 1:
        problems = [r["problem"] for r in all_gather_records({"problem": problem})]
        first = next((r for r, p in enumerate(problems) if p is not None), None)
        if problem is not None:  # this rank's own problem first, else the first rank's
            raise ValueError(problem)
        if first is not None:
            raise ValueError(f"rank {first}: {problems[first]}")
    elif problem is not None:
        raise ValueError(problem)
    previous = [layer.route_replay for _, layer in layers]
    for (_, layer), replay in zip(layers, replays):
        layer.route_replay = replay
    try:
        yield
    finally:
        for (_, layer), replay in zip(layers, previous):
            layer.route_replay = replay
        for replay in replays:
            replay.left = True


def _prepared(layers: list[tuple[str, MoELayer]], routes: Routes, weights: bool) -> list[_Replay]:
    """One checked _Replay per layer (ValueError naming the file, the layer and the record)."""
    names = [name for name, _ in layers]
    src = "" if routes.source is None else f"routes file {str(routes.source)!r}: "
    rank, world = _rank_and_world_now()
    if routes.rank is not None and world > 1 and (routes.rank, routes.world) != (rank, world):
        raise ValueError(
            f"{src}recorded on rank {routes.rank} of {routes.world}, replayed on rank {rank} "
            f"of {world}: each rank replays its own routes ({{rank}} in the file name)"
        )
    for name in names:
        if name not in routes.layers:
            raise ValueError(f"{src}{name}: the routes have no records for this MoE layer")
    for name in routes.layers:
        if name not in names:
            raise ValueError(f"{src}{name:.200}: the routes name a layer the model does not have")
    return [
        _Replay(name, _checked(src + name, layer, routes.layers[name]), weights)
        for name, layer in layers
    ]


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
        experts_TK = torch.where(ids_TK < 0, ~ids_TK, ids_TK).sort(1).values  # declined ~e: e
        if (experts_TK[:, 1:] == experts_TK[:, :-1]).any():
            row = int((experts_TK[:, 1:] == experts_TK[:, :-1]).any(1).nonzero()[0])
            raise ValueError(f"{where}: token {row} names one expert twice")
        if not torch.isfinite(weights_TK).all():
            raise ValueError(f"{where}: the recorded weights are not all finite")
        out.append(RouteRecord(ids_TK.to(device), weights_TK.to(device)))
    return out


__all__ = ["RouteRecord", "Routes", "RoutesFileError", "record_routing", "replay_routing"]
