"""moe.plan's shared links, reduce-scatter factor, expert-parallel overhead, offloaded
optimizer step and what FSDP2 holds through a pipeline's micro-batches (issue 48): the terms
by hand. The profile measuring them runs in tests/test_plan_measured.py."""

from dataclasses import replace

import pytest

from moe.plan import Layout, predict, preset
from moe.plan.cluster import Cluster
from moe.plan.spec import ModelSpec

SEQ = 32


def _spec() -> ModelSpec:
    return ModelSpec(name="t", n_layers=4, d_model=64, n_heads=4, vocab_size=128, num_experts=8,
                     top_k=2, d_ff_expert=96, d_ff_dense=96, gated=False)  # fmt: skip


def _cluster(**kw) -> Cluster:
    """2 nodes x 2 ranks, nothing overlapped, no latencies: the byte terms alone."""
    base = dict(intra_latency=0.0, inter_latency=0.0, dp_overlap=0.0, inter_bw=1e9)
    return preset("h100", nodes=2, gpus_per_node=2, **{**base, **kw})


def _time(cluster: Cluster, layout: Layout, term: str) -> float:
    return predict(_spec(), cluster, layout, SEQ, layout.world * SEQ).time[term]


def test_a_shared_link_divides_bandwidth_among_groups_side_by_side():
    """nic_ranks = 2: rings of one group per node (the dense ranks, stride 1) keep the link;
    the experts' dp groups (stride ep = 2) cross side by side at half of it, as do a stage's
    p2p sends and every all-to-all across nodes (all of a node's ranks exchange at once)."""
    one, two = _cluster(), _cluster(nic_ranks=2)
    half = _cluster(inter_bw=0.5e9)
    dense_only = Layout(1, 4, 1, "ddp")
    assert _time(two, dense_only, "dp_comms") == _time(one, dense_only, "dp_comms") > 0
    lay = Layout(1, 2, 2, "ddp")
    spec = _spec()
    P = spec.total_params() - spec.n_layers * 8 * 2 * 64 * 96  # dense parameters
    X = spec.n_layers * 8 * 2 * 64 * 96
    dense = 2 * 3 * (2 * P / 4 / 1e9)  # all-reduce: 2 (n - 1) steps of bytes / n / bw
    experts = 2 * 1 * (2 * X / 2 / 2 / 1e9)  # over dp = 2 (stride ep = 2), local experts
    assert _time(one, lay, "dp_comms") == pytest.approx(dense + experts)
    assert _time(two, lay, "dp_comms") == pytest.approx(dense + 2 * experts)
    a2a = Layout(1, 1, 4, "ddp")
    assert _time(two, a2a, "all_to_all") == pytest.approx(_time(half, a2a, "all_to_all"))
    assert _time(two, a2a, "all_to_all") > _time(one, a2a, "all_to_all")
    piped = Layout(2, 2, 1, "ddp", "1F1B", 1, 4, 1)  # stages on different nodes
    assert _time(two, piped, "p2p") == pytest.approx(_time(half, piped, "p2p"))
    assert _time(two, piped, "p2p") > _time(one, piped, "p2p")
    # one NIC per GPU (the presets): nothing shared
    assert preset("h100").nic_ranks == 1 and one.cost_model().bw_inter == 1e9


def test_reduce_scatter_factor_scales_fsdp_reduce_scatter_only():
    """fsdp with m micro-batches at pp = 1: 2 m gathers and m reduce-scatters (FSDP2 reduces
    in every backward) of the same bytes, a reduce-scatter reduce_scatter_factor times a
    gather; ddp's all-reduce is untouched."""
    fsdp = Layout(1, 4, 1, "fsdp", microbatches=3)
    one, two = _cluster(), _cluster(reduce_scatter_factor=2.0)
    assert _time(two, fsdp, "dp_comms") / _time(one, fsdp, "dp_comms") == pytest.approx(12 / 9)
    ddp = Layout(1, 4, 1, "ddp", microbatches=3)
    assert _time(two, ddp, "dp_comms") == _time(one, ddp, "dp_comms")


def test_ep_overhead_per_moe_block_and_micro_batch_under_ep_only():
    base, cl, n = _cluster(), _cluster(ep_overhead=1e-3), _spec().moe_layers
    for lay, added in ((Layout(1, 2, 2, "ddp", microbatches=3), 3 * n * 1e-3),
                       (Layout(1, 4, 1, "ddp", microbatches=3), 0.0)):  # fmt: skip
        assert _time(cl, lay, "compute") - _time(base, lay, "compute") == pytest.approx(added)
    moe = Layout(1, 2, 2, "ddp", recompute="moe")  # the recomputed forward runs it again
    recomputed = _time(cl, moe, "compute") - _time(base, moe, "compute")
    assert n * 1e-3 < recomputed <= n * 1e-3 * (1 + 1 / 3) + 1e-12


def test_offloaded_steps_use_the_offloaded_figures():
    """An offloaded step: its own per-parameter and per-tensor costs (a CPU profile measures
    both paths: plain host tensors skip DTensor dispatch); the device step keeps its own."""
    cl = _cluster(offload_overhead=2e-3, offload_param_overhead=1e-6, optimizer_overhead=5e-3)
    blocks, local = _spec().n_layers, _spec().total_params()
    off = predict(_spec(), cl, Layout(1, 4, 1, "ddp", offload="optimizer"), SEQ, 4 * SEQ)
    assert off.time["optimizer"] == 0
    assert off.time["offload"] == pytest.approx(local * 1e-6 + (blocks + 1) * 2e-3)
    on = predict(_spec(), cl, Layout(1, 4, 1, "ddp"), SEQ, 4 * SEQ)
    assert on.time["offload"] == 0
    assert on.time["optimizer"] == pytest.approx(local * 32 / cl.hbm_bw + (blocks + 1) * 5e-3)


def test_a_pipeline_stage_holds_unsharded_gradients_until_its_last_micro_batch():
    """pp > 1 with m > 1 micro-batches: torch's pipelining skips FSDP2's gradient sync for all
    but the last, so a rank accumulates its chunks' gradients unsharded through forward and
    backward (ddp: as large as its parameters), and fsdp keeps the parameters gathered too;
    both are freed before the optimizer step."""
    cl = _cluster()

    def memory(mode, m):
        lay = Layout(2, 2, 1, mode, "1F1B", microbatches=m)
        return predict(_spec(), cl, lay, SEQ, 2 * m * SEQ).memory

    ddp, ddp1 = memory("ddp", 4), memory("ddp", 1)
    assert ddp["comms"] - ddp1["comms"] == pytest.approx(ddp["parameters"])
    fsdp, fsdp1 = memory("fsdp", 4), memory("fsdp", 1)
    unsharded = ddp["parameters"] / 2  # the rank's chunks' parameters, gathered over dp
    # (the fullest rank may differ by the final norm: rel)
    assert fsdp["comms"] - ddp["comms"] == pytest.approx(2 * unsharded, rel=1e-3)
    assert fsdp1["comms"] < fsdp["comms"]
    assert ddp["temporaries"] == ddp1["temporaries"]


@pytest.mark.parametrize(
    "field, value, why",
    [("nic_ranks", 0, "nic_ranks must be an int >= 1"),
     ("nic_ranks", 1.5, "nic_ranks must be an int >= 1"),
     ("reduce_scatter_factor", 0.5, "reduce_scatter_factor must be >= 1"),
     ("ep_overhead", -1.0, "ep_overhead must be > 0"),
     ("fsdp_gathered_units", 0, "fsdp_gathered_units must be an int >= 1")],
)  # fmt: skip
def test_bad_link_figures_are_refused(field, value, why):
    with pytest.raises(ValueError, match=why):
        replace(_cluster(), **{field: value})
