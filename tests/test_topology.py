"""Topology detection and override validation; cross-rank config mismatch detection."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from moe.comm.consistency import check_same_across_ranks, describe_mismatch
from moe.comm.topology import (
    Topology,
    get_topology,
    ranks_per_node_from_layout,
    validate_ranks_per_node,
)
from tests.distributed import run_ranks


def test_validate_ranks_per_node():
    assert validate_ranks_per_node("4", 8, "MOE_RANKS_PER_NODE") == 4
    for value, fragment in [
        ("3", "does not divide"),
        ("0", ">= 1"),
        ("x", "not an integer"),
        (16, "larger than the group size"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            validate_ranks_per_node(value, 8, "MOE_RANKS_PER_NODE")


def test_layout_detection():
    assert ranks_per_node_from_layout(["a", "a", "b", "b"]) == 2
    assert ranks_per_node_from_layout(["a"] * 4) == 4
    assert ranks_per_node_from_layout(["a", "b", "a", "b"]) is None  # not node-major
    assert ranks_per_node_from_layout(["a", "a", "a", "b"]) is None  # unequal nodes


def test_topology_coordinates():
    t = Topology(group_size=8, ranks_per_node=4, rank=6, source="argument")
    assert (t.num_nodes, t.node, t.local_rank, t.is_multi_node) == (2, 1, 2, True)
    assert not Topology(8, 8, 0, "env").is_multi_node


def test_describe_mismatch():
    same = [{"num_experts": 8, "top_k": 2}] * 3
    assert describe_mismatch(same) is None
    diff = [{"num_experts": 8}, {"num_experts": 8}, {"num_experts": 8}, {"num_experts": 4}]
    assert (
        describe_mismatch(diff)
        == "num_experts differs across ranks: ranks 0-2 have 8, rank 3 has 4"
    )
    missing = [{"a": 1, "b": 2}, {"a": 1}]
    assert describe_mismatch(missing) == "b differs across ranks: rank 0 has 2, rank 1 has missing"


def _topology_body(rank: int, world_size: int):
    out = {}
    out["torchrun"] = get_topology().ranks_per_node  # harness sets LOCAL_WORLD_SIZE = world
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out["lws2"] = get_topology().ranks_per_node
    del os.environ["LOCAL_WORLD_SIZE"]
    out["hostname"] = (get_topology().ranks_per_node, get_topology().source)
    os.environ["MOE_RANKS_PER_NODE"] = "1"
    out["env"] = get_topology().ranks_per_node
    out["argument wins"] = get_topology(ranks_per_node=2).ranks_per_node
    del os.environ["MOE_RANKS_PER_NODE"]
    check_same_across_ranks({"num_experts": 8, "top_k": 2, "ep": world_size})
    try:
        check_same_across_ranks({"num_experts": 8, "top_k": 1 if rank == 3 else 2})
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    dist.barrier()  # still in step after the failed check
    return out


def test_detection_and_mismatch_on_4_ranks():
    results = run_ranks(_topology_body, 4, timeout=30)
    for out in results:
        assert out["torchrun"] == 4
        assert out["lws2"] == 2
        assert out["hostname"] == (4, "hostname")
        assert out["env"] == 1
        assert out["argument wins"] == 2
        assert out["mismatch"] == "top_k differs across ranks: ranks 0-2 have 2, rank 3 has 1"
