"""Gradient syncs per step in moe.plan (issue 62 item 10, found measuring `--layout auto`):
at pp = 1 a model under parallelize reduces its gradients in every backward (FSDP2's
default; the M6 example and the planner's printed code accumulate micro-batches that way), so
m micro-batches cost m reductions; a pipeline syncs once a step (torch's pipelining turns the
sync off until the last micro-batch). The planner charged one reduction a step at pp = 1."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

import moe
from moe.plan import Layout, ModelSpec, predict, preset
from tests.distributed import run_ranks

SPEC = ModelSpec("t", 4, 256, 4, 1000, 8, 2, 256, 512)


@pytest.mark.parametrize("dpm", ["ddp", "fsdp"])
def test_pp1_reduces_per_micro_batch_pipelines_once(dpm):
    cl, seq = preset("h100", 1, gpus_per_node=4, dp_overlap=0.0), 64  # nothing hidden
    one = Layout(1, 4, 1, dpm, microbatches=1, micro_batch_seqs=2)
    four = replace(one, microbatches=4)
    a = predict(SPEC, cl, one, seq, 4 * 2 * seq).time["dp_comms"]
    b = predict(SPEC, cl, four, seq, 4 * 8 * seq).time["dp_comms"]
    if dpm == "ddp":
        assert b == pytest.approx(4 * a, rel=1e-12)
    else:  # gathers per micro-batch were already counted: the reduce-scatters now too
        assert b == pytest.approx(4 * a, rel=1e-12)
    piped = Layout(2, 2, 1, dpm, "GPipe", microbatches=1, micro_batch_seqs=2)
    c = predict(SPEC, cl, piped, seq, 2 * 2 * seq).time["dp_comms"]
    d = predict(SPEC, cl, replace(piped, microbatches=4), seq, 2 * 8 * seq).time["dp_comms"]
    if dpm == "ddp":
        assert d == pytest.approx(c, rel=1e-12)  # one all-reduce a step
    else:
        assert d > c and d < 4 * c  # gathers per micro-batch, one reduce-scatter


def _count_all_reduces(rank, world):
    """all_reduce calls of m micro-batches' backwards under parallelize's ddp (FSDP2's
    replicate issues its gradient all-reduces through torch.distributed.all_reduce)."""
    calls = []
    original = c10d.all_reduce

    def counted(*args, **kw):
        calls.append(1)
        return original(*args, **kw)

    c10d.all_reduce = dist.all_reduce = counted
    model = nn.Sequential(nn.Linear(8, 8), moe.MoELayer(8, 16, 4, top_k=1), nn.Linear(8, 8))
    moe.parallel.parallelize(model, moe.parallel.init_mesh(dp=world, ep=1), data_parallel="ddp")
    out = {}
    for m in (1, 3):
        calls.clear()
        for _ in range(m):
            model(torch.randn(4, 8)).sum().backward()
        out[m] = len(calls)
    return out


def test_the_library_reduces_in_every_backward_at_pp1():
    """What the model above assumes, measured (ddp): 3 micro-batches, 3x one's all-reduces."""
    got = run_ranks(_count_all_reduces, 2, timeout=240)[0]
    assert got[1] > 0 and got[3] == 3 * got[1], got
