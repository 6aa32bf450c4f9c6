"""Node topology of a process group: ranks per node, and the cached 2D subgroups.

The hierarchical all-to-all needs to know which ranks share a node. One function,
`ranks_per_node_setting`, decides it for every caller (parallelize's agreement check, the
dispatchers, a direct exchange); first match wins:
  1. the setting given in code: a ``ranks_per_node=`` argument or ``ExchangeConfig.ranks_per_node``
     (both given and different: a ValueError),
  2. ``MOE_RANKS_PER_NODE`` (lets one machine emulate N nodes x G ranks), read when the
     ExchangeConfig was built (parallelize builds one when given none),
  3. torchrun's ``LOCAL_WORLD_SIZE`` (node of global rank g is g // LOCAL_WORLD_SIZE),
  4. gathering host names over the group (one small collective, done once and cached).
`resolve_ranks_per_node` is that decision for one group as a number: parallelize resolves it
once per EP group and hands it to the dispatchers, which pass it to every exchange and expose
it as `Dispatcher.ranks_per_node` (what the replica split reads), so both read one value.
Ranks are assumed node-major inside the group (group rank r sits on node r // ranks_per_node),
which is how torchrun numbers them. A detected layout that is not node-major with equal node
sizes is treated as one node (so "auto" picks the flat path); results stay correct either way.
"""

from __future__ import annotations

import datetime
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.comm.exchange_config import ExchangeConfig, env_var, resolved

ENV_RANKS_PER_NODE = env_var("ranks_per_node")

_TOPOLOGY_CACHE: dict[tuple, Topology] = {}
_SUBGROUP_CACHE: dict[tuple, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


@dataclass(frozen=True)
class Topology:
    """Where this rank sits in an N x L grid of its group (N nodes, L ranks per node)."""

    group_size: int  # W = N * L
    ranks_per_node: int  # L
    rank: int  # this process's rank inside the group
    source: str  # where ranks_per_node came from: argument, env, LOCAL_WORLD_SIZE, hostname

    @property
    def num_nodes(self) -> int:
        return self.group_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def is_multi_node(self) -> bool:
        """True when a 2D exchange has two real stages (N > 1 and L > 1)."""
        return self.num_nodes > 1 and self.ranks_per_node > 1


def validate_ranks_per_node(ranks_per_node: object, group_size: int, source: str) -> int:
    """Return ranks_per_node as an int, or raise ValueError naming the source and the problem."""
    try:
        value = int(str(ranks_per_node).strip())
    except ValueError:
        raise ValueError(f"{source}={ranks_per_node!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{source}={value} must be >= 1")
    if value > group_size:
        raise ValueError(f"{source}={value} is larger than the group size {group_size}")
    if group_size % value != 0:
        raise ValueError(
            f"{source}={value} does not divide the group size {group_size} "
            f"(need group_size = num_nodes * ranks_per_node)"
        )
    return value


def group_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """Global ranks of the members of ``group`` in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def ranks_per_node_from_layout(node_ids: list[object]) -> int | None:
    """L if ``node_ids`` (one per group rank) is node-major with equal node sizes, else None."""
    blocks: list[tuple[object, int]] = []
    for node_id in node_ids:
        if blocks and blocks[-1][0] == node_id:
            blocks[-1] = (node_id, blocks[-1][1] + 1)
        else:
            blocks.append((node_id, 1))
    names = [b[0] for b in blocks]
    sizes = {b[1] for b in blocks}
    if len(set(names)) != len(names) or len(sizes) != 1:
        return None
    return sizes.pop()


def ranks_per_node_setting(
    ranks_per_node: int | None, group_size: int, exchange_config: ExchangeConfig | None = None
) -> tuple[int, str] | None:
    """The ranks per node of the group, validated, and where it came from: "argument",
    "config" (ExchangeConfig.ranks_per_node given in code), "env" (MOE_RANKS_PER_NODE, read
    when the config was built) or "LOCAL_WORLD_SIZE" (also read then); None when host names
    must decide (a collective). An argument and a config field given in code that differ: a
    ValueError."""
    config = resolved(exchange_config)
    field, source = config.ranks_per_node, config.source("ranks_per_node")
    if ranks_per_node is not None:
        value = validate_ranks_per_node(ranks_per_node, group_size, "ranks_per_node")
        if source == "code" and field != value:
            raise ValueError(
                f"ranks_per_node={value} and ExchangeConfig.ranks_per_node={field} differ: give one"
            )
        return value, "argument"
    if field is not None:
        by = "env" if source == "env" else "config"
        name = ENV_RANKS_PER_NODE if by == "env" else "ExchangeConfig.ranks_per_node"
        return validate_ranks_per_node(field, group_size, name), by
    if config.local_world_size is None:
        return None
    world, text = dist.get_world_size(), config.local_world_size
    return validate_ranks_per_node(text, world, "LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE"


def _detect(
    group: dist.ProcessGroup | None, global_ranks: list[int], local_world: int | None
) -> tuple[int, str]:
    """ranks_per_node from LOCAL_WORLD_SIZE (given) or host names, for a layout of the
    group's ranks (a subgroup of the world may not be node-major)."""
    if local_world is not None:
        node_ids: list[object] = [g // local_world for g in global_ranks]
        source = "LOCAL_WORLD_SIZE"
    else:
        hosts: list[object] = [None] * len(global_ranks)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        node_ids = hosts
        source = "hostname"
    ranks_per_node = ranks_per_node_from_layout(node_ids)
    if ranks_per_node is None:
        warnings.warn(
            f"group ranks are not node-major with equal node sizes ({source}); "
            "treating the group as one node, so hierarchical all-to-all degenerates to flat",
            stacklevel=3,
        )
        return len(global_ranks), f"{source} (irregular layout: one node)"
    return ranks_per_node, source


def get_topology(
    group: dist.ProcessGroup | None = None,
    ranks_per_node: int | None = None,
    exchange_config: ExchangeConfig | None = None,
) -> Topology:
    """Topology of ``group`` for this rank; detection runs once per group and is cached.

    Must be called by every rank of the group at the same point when detection falls back to
    host names (that path is a collective).
    """
    group_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    global_ranks = group_ranks(group)
    setting = ranks_per_node_setting(ranks_per_node, group_size, exchange_config)
    key = (
        id(dist.group.WORLD),  # a re-initialised default group invalidates the cache
        tuple(global_ranks),
        setting,
    )
    cached = _TOPOLOGY_CACHE.get(key)
    if cached is not None:
        return cached
    if setting is None or setting[1] == "LOCAL_WORLD_SIZE":
        value, source = _detect(group, global_ranks, setting and setting[0])
    else:
        value, source = setting
    topo = Topology(group_size=group_size, ranks_per_node=value, rank=rank, source=source)
    _TOPOLOGY_CACHE[key] = topo
    return topo


def resolve_ranks_per_node(
    group: dist.ProcessGroup | None,
    ranks_per_node: int | None = None,
    exchange_config: ExchangeConfig | None = None,
) -> int:
    """The ranks per node of `group` the exchange uses (get_topology's, cached): the setting
    by the precedence above, else detected (host names: a collective over `group`, so every
    member must call it at the same point)."""
    return get_topology(group, ranks_per_node, exchange_config).ranks_per_node


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The collective timeout of ``group`` (so subgroups fail as fast as their parent)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - private API; fall back to torch's default
            continue
    return None


def get_subgroups(
    topo: Topology, group: dist.ProcessGroup | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(intra-node group, inter-node group of equal local index) for this rank; cached.

    For the default group every rank creates all subgroups in one global order (what
    ``new_group`` requires). For a proper subgroup of the world (an EP group inside EP x DP)
    only its members call, so the groups are created with ``use_local_synchronization``; every
    member creates its intra group first and its inter group second, so no creation waits on a
    rank busy creating another group.
    """
    global_ranks = group_ranks(group)
    key = (id(dist.group.WORLD), tuple(global_ranks), topo.ranks_per_node)
    cached = _SUBGROUP_CACHE.get(key)
    if cached is not None:
        return cached
    if global_ranks != sorted(global_ranks):
        raise ValueError(
            "hierarchical all-to-all needs a group whose ranks are in ascending global order, "
            f"got {global_ranks}"
        )
    L, N = topo.ranks_per_node, topo.num_nodes
    timeout = group_timeout(group)
    intra_lists = [[global_ranks[n * L + l] for l in range(L)] for n in range(N)]
    inter_lists = [[global_ranks[n * L + l] for n in range(N)] for l in range(L)]
    if len(global_ranks) == dist.get_world_size():
        intra_all = [dist.new_group(r, timeout=timeout) for r in intra_lists]
        inter_all = [dist.new_group(r, timeout=timeout) for r in inter_lists]
        intra, inter = intra_all[topo.node], inter_all[topo.local_rank]
    else:
        intra = dist.new_group(
            intra_lists[topo.node], timeout=timeout, use_local_synchronization=True
        )
        inter = dist.new_group(
            inter_lists[topo.local_rank], timeout=timeout, use_local_synchronization=True
        )
    _SUBGROUP_CACHE[key] = (intra, inter)
    return intra, inter
