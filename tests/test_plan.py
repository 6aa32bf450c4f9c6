"""moe.plan (issue 48): parameter counts against transformers' real models and the published
totals, the memory and time terms against hand-computed cases, monotonicity, the schedules'
rules, bad input, and the command line."""

import importlib.util
import math
from dataclasses import replace

import pytest
import torch

from moe.plan import HF_CONFIGS, Layout, load_model, predict, preset, search
from moe.plan.cli import main, tokens
from moe.plan.cluster import Cluster
from moe.plan.predict import BUBBLE_FACTOR, in_flight
from moe.plan.profile import fit_link, fit_rate
from moe.plan.search import refusal
from moe.plan.skew import imbalance, zipf_load
from moe.plan.spec import ModelSpec, from_hf_config
from moe.plan.stages import chunks

# the presets' configs are read, and their parameters counted, by transformers (moe.plan.models)
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)

TINY = {
    "Qwen3MoeConfig": dict(
        vocab_size=97, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=6, num_experts_per_tok=2,
    ),
    "MixtralConfig": dict(
        vocab_size=97, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2,
    ),
    "DeepseekV3Config": dict(
        vocab_size=97, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, n_group=1, topk_group=1,
    ),
    "OlmoeConfig": dict(
        vocab_size=97, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
        eos_token_id=1, pad_token_id=0, bos_token_id=None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TINY))
def test_parameter_counts_equal_transformers_models(name):
    """The arithmetic counts equal the real transformers model's, built on the meta device."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, name)(**TINY[name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    spec = from_hf_config(config.to_dict(), name)
    assert spec.total_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name, total, active",
    [  # the model cards' totals (billions); DeepSeek-V3 without its MTP module
        ("deepseek-v3", 671, 37),
        ("kimi-k2", 1000, 32),
        ("qwen3-30b-a3b", 30.5, 3.3),
        ("mixtral-8x7b", 46.7, 12.9),
    ],
)
@needs_transformers
def test_presets_match_published_totals(name, total, active):
    spec = load_model(name)
    assert spec.total_params() / 1e9 == pytest.approx(total, rel=0.03)
    assert spec.active_params() / 1e9 == pytest.approx(active, rel=0.03)


def _spec(**kw) -> ModelSpec:
    base = dict(name="t", n_layers=4, d_model=64, n_heads=4, vocab_size=128, num_experts=8,
                top_k=2, d_ff_expert=96, d_ff_dense=96, gated=False)  # fmt: skip
    return ModelSpec(**{**base, **kw})


def _cluster(**kw) -> Cluster:
    return preset("h100", **kw)


def test_memory_terms_by_hand():
    """pp 1, ddp, ep 2: parameters 2 B x (dense + experts / 2), gradients the same, Adam 12 B,
    temporaries 8 B / groups, the all-to-all buffers 2 t k h x 2 B, one parallelize unit's
    gradients in flight (FSDP2's replicate reduces unit by unit). fsdp: the local shards, and
    in the forward / backward phase two gathered units where the next gather runs ahead
    (GPU streams), one where ops run synchronously (a CPU)."""
    spec, seq = _spec(), 32
    lay = Layout(1, 2, 2, "ddp", microbatches=3, micro_batch_seqs=2, groups=4)
    pred = predict(spec, _cluster(), lay, seq, 4 * 3 * 2 * seq)
    attn = 4 * 64 * 64
    dense = 4 * (attn + 2 * 64 + 64 * 8) + 128 * 64 + 64 + 128 * 64  # + router, embed, head
    experts = 4 * 8 * 2 * 64 * 96
    local = dense + experts / 2
    assert pred.memory["parameters"] == 2 * local
    assert pred.memory["gradients"] == 2 * local
    assert pred.memory["optimizer"] == 12 * local
    assert pred.memory["temporaries"] == 8 * local / 4
    t = 2 * seq
    unit = max(dense / 4, experts / 4 / 2)  # a block's dense part, a layer's local experts
    assert pred.memory["comms"] == pytest.approx(2 * t * 2 * 64 * 2 + 2 * unit)
    fsdp = Layout(1, 2, 2, "fsdp", microbatches=3, micro_batch_seqs=2)
    one, two = (predict(spec, _cluster(fsdp_gathered_units=n), fsdp, seq, 4 * 3 * 2 * seq)
                for n in (1, 2))  # fmt: skip
    shard = dense / 4 + experts / 4
    fsdp_unit = max(dense / 4, experts / 4 / 2)
    assert one.memory["parameters"] == pytest.approx(2 * shard)
    assert one.memory["gradients"] == pytest.approx(2 * shard)
    assert two.memory["comms"] - one.memory["comms"] == pytest.approx(2 * fsdp_unit)
    assert two.memory["temporaries"] == one.memory["temporaries"]  # freed before the step
    per_token = chunks(spec, seq, 1, None)[0].act
    head = 128 * 6 * t
    assert pred.memory["activations"] == pytest.approx(per_token * t + head)
    off = predict(spec, _cluster(), replace(lay, offload="optimizer"), seq, 4 * 3 * 2 * seq)
    assert off.memory["optimizer"] == 4 * local and off.memory["temporaries"] == 0


def test_time_terms_by_hand():
    """Compute: m x 3 forwards at the cluster's GEMM rates; the all-to-all: 4 exchanges per
    MoE block and micro-batch of the CostModel's flat time; no bubble or p2p at pp = 1."""
    spec, seq, cl = _spec(), 32, _cluster()
    lay = Layout(1, 1, 4, "ddp", microbatches=3, micro_batch_seqs=2)
    pred = predict(spec, cl, lay, seq, 4 * 3 * 2 * seq)
    t = 2 * seq
    c = chunks(spec, seq, 1, None)[0]
    rows = t * 2 * 4 / 8  # per expert: t k ep / E
    fwd = c.dense_flops * t / cl.gemm_rate(t) + c.routed_flops * t / cl.gemm_rate(rows)
    assert pred.time["compute"] == pytest.approx(3 * 3 * fwd)
    a2a = cl.cost_model().flat_time(t * 2 * 64 * 2, 1, 4)
    assert pred.time["all_to_all"] == pytest.approx(3 * 4 * 4 * a2a)
    assert pred.time["bubble"] == 0 and pred.time["p2p"] == 0
    hidden = replace(lay, overlap=2)
    assert predict(spec, cl, hidden, seq, 4 * 3 * 2 * seq).time["all_to_all"] < a2a * 48
    piped = Layout(2, 1, 2, "ddp", "1F1B", 1, 4, 1)
    pp = predict(spec, cl, piped, seq, 2 * 4 * seq)
    per_mb = pp.time["compute"] / 4
    assert pp.time["bubble"] == pytest.approx(per_mb * 1)  # (p - 1) micro-batch times


def test_pipeline_bubble_and_in_flight_rules():
    assert [in_flight("1F1B", 8, 4, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("GPipe", 8, 4, 1, 0) == 8
    assert in_flight("Interleaved1F1B", 8, 4, 2, 0) == (2 * 3 + 4 + 1) / 2
    assert in_flight("none", 8, 1, 1, 0) == 1
    assert BUBBLE_FACTOR["InterleavedZeroBubble"] == pytest.approx(1 / 3)
    spec = _spec(n_layers=8)  # 1F1B needs >= pp micro-batches, DualPipeV >= 2 pp
    assert refusal(spec, Layout(4, 1, 1, "ddp", "1F1B", 1, 3)) is not None
    assert refusal(spec, Layout(4, 1, 1, "ddp", "DualPipeV", 2, 3)) is not None
    assert refusal(spec, Layout(4, 1, 1, "ddp", "GPipe", 1, 3)) is None
    assert refusal(spec, Layout(4, 1, 1, "ddp", "DualPipeV", 2, 8)) is None


@needs_transformers
def test_more_bandwidth_never_slower_more_memory_never_fits_fewer():
    spec = load_model("mixtral-8x7b")
    tok, seq = 1024 * 4096, 4096
    base = _cluster(nodes=4)
    lay = Layout(2, 4, 4, "fsdp", "1F1B", 1, 8, 2, recompute="full")
    times = []
    for k in (0.5, 1, 2, 4):
        cl = replace(base, inter_bw=base.inter_bw * k, intra_bw=base.intra_bw * k)
        times.append(predict(spec, cl, lay, seq, tok).step_time)
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    fits = []
    for mem in (40, 80, 160):
        result = search(spec, replace(base, device_memory_gib=mem), tok, seq, top=10**6)
        fits.append(len(result.fits))
    assert fits == sorted(fits) and fits[0] < fits[-1]
    best = [search(spec, replace(base, inter_bw=base.inter_bw * k), tok, seq).best().step_time
            for k in (1, 4)]  # fmt: skip
    assert best[1] <= best[0]


def test_skew_and_replicas():
    uniform = zipf_load(8, 0.0)
    assert imbalance(uniform, 4) == pytest.approx(1.0)
    hot = zipf_load(8, 1.5)
    assert imbalance(hot, 4) > 1.2
    assert imbalance(hot, 4, spare_slots=4) < imbalance(hot, 4)
    spec = _spec()
    lay = Layout(1, 1, 4, "ddp", microbatches=2, micro_batch_seqs=2)
    slow = predict(spec, _cluster(), lay, 32, 4 * 2 * 2 * 32, load=hot)
    even = predict(spec, _cluster(), lay, 32, 4 * 2 * 2 * 32, load=uniform)
    assert slow.time["compute"] > even.time["compute"]


@needs_transformers
def test_search_ranks_and_prints_code():
    spec = load_model("qwen3-30b-a3b")
    result = search(spec, _cluster(nodes=2), 512 * 4096, 4096, top=5)
    steps = [p.step_time for p in result.fits]
    assert steps == sorted(steps) and len(steps) == 5
    for p in result.fits:
        assert p.fits and p.layout.world == 16
        assert "parallelize" in p.layout.code() or "Pipeline(" in p.layout.code()
        assert f"--ep {p.layout.ep}" in p.layout.m6_flags()
        assert 0 < p.mfu < 1


@needs_transformers
def test_bad_input_is_one_clear_error():
    spec = load_model("mixtral-8x7b")
    with pytest.raises(ValueError, match="fits no layout on 1 x 8 devices of 4 GiB"):
        search(spec, _cluster(device_memory_gib=4), 64 * 4096, 4096)
    with pytest.raises(ValueError, match="not a whole number of sequences"):
        search(spec, _cluster(), 1000, 4096)
    with pytest.raises(ValueError, match="fewer than the 16 devices"):
        search(spec, _cluster(nodes=2), 8 * 4096, 4096)
    with pytest.raises(ValueError, match="unknown cluster preset 'a100'"):
        preset("a100")
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        load_model("gpt-9")
    with pytest.raises(ValueError, match="has no routed experts"):
        from_hf_config({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="gemm_efficiency must be in"):
        replace(_cluster(), gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="bw_inter"):
        replace(_cluster(), inter_bw=1e20)


def test_cluster_file_round_trip_and_refusals(tmp_path):
    path = tmp_path / "c.json"
    _cluster(nodes=3).save(path)
    assert Cluster.load(path) == _cluster(nodes=3)
    path.write_text('{"version": 1, "nodes": 1}')
    with pytest.raises(ValueError, match="cluster fields missing"):
        Cluster.load(path)
    path.write_text('{"version": 1, "nodes": 1, "evil": 2}')
    with pytest.raises(ValueError, match="unknown cluster fields"):
        Cluster.load(path)


def test_profile_fits():
    rows = [16, 64, 256, 1024]
    R, h = 5e12, 100.0
    assert fit_rate(rows, [R * r / (r + h) for r in rows]) == pytest.approx((R, h), rel=1e-6)
    sizes = [1 << 12, 1 << 16, 1 << 20]
    bw, lat = fit_link(sizes, [2e-5 + s / 1e10 for s in sizes])
    assert bw == pytest.approx(1e10, rel=1e-6) and lat == pytest.approx(2e-5, rel=1e-6)


@needs_transformers
def test_cli_prints_table_and_code(capsys, tmp_path):
    assert tokens("4M") == 4 * 2**20 and tokens("65536") == 65536
    png, js = tmp_path / "p.png", tmp_path / "p.json"
    argv = ["--model", "qwen3-30b-a3b", "--nodes", "2", "--tokens", "2M", "--top", "3"]
    assert main([*argv, "--plot", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "| 1 | pp" in out and "| 3 | pp" in out and "# M6 example flags" in out
    assert png.stat().st_size > 1000 and js.stat().st_size > 100
    with pytest.raises(SystemExit):
        main(["--model", "qwen3-30b-a3b", "--tokens", "4X"])
    assert "not a token count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "mixtral-8x7b", "--tokens", "64K", "--gpu-mem", "2"])
    assert "fits no layout" in capsys.readouterr().err


@needs_transformers
def test_hf_presets_cover_the_search():
    for name in HF_CONFIGS:
        spec = load_model(name)
        assert spec.total_params() > spec.active_params() > 0
        assert math.isfinite(spec.layer_flops(spec.n_layers - 1, 4096)[0])


@needs_transformers
def test_profile_writes_a_cluster_the_planner_reads(tmp_path, capsys):
    from moe.plan.profile import main as profile

    out = tmp_path / "cluster.json"
    assert profile(["--out", str(out), "--d-model", "64", "--d-ff", "64", "--device-mem", "4"]) == 0
    cluster = Cluster.load(out)
    assert cluster.name == "profile" and "measured" in cluster.source
    assert cluster.device_memory_gib == 4 and cluster.tflops_bf16 > 0
    # one process on CPU: the fixed costs measured, no collective to time
    assert cluster.block_overhead > 0 and cluster.step_overhead > 0
    assert cluster.optimizer_overhead > 0 and cluster.collective_latency == 0
    # float32, torch's per-tensor CPU step: temporaries of one tensor at a time
    # (a = 0: no fp32 copies of fp32 gradients; b = 12 for torch's AdamW, overhead.py)
    assert (cluster.optimizer_temp_bytes, cluster.optimizer_tensor_temp_bytes) == (0, 12)
    argv = ["--model", "mixtral-tiny", "--cluster", str(out), "--tokens", "4K", "--seq-len", "64"]
    assert main(argv) == 0
    assert "| 1 | pp" in capsys.readouterr().out


@needs_transformers
def test_published_report_runs():
    from bench.plan_published import CASES, run_case

    text = run_case(next(c for c in CASES if c.model == "mixtral-8x7b"))
    assert "**Published layout**" in text and ": fits," in text and "Verdict:" in text
    assert "NEITHER" not in text


def test_fixed_overheads_add_their_documented_terms():
    """The profile's fixed costs (moe/plan/overhead.py) add exactly predict's documented
    terms: per micro-batch blocks x (block_overhead + t block_token_overhead) + MoE blocks x
    (moe_overhead + t moe_token_overhead) (x (1 + the recomputed forward share / 3)) +
    step_overhead + t step_token_overhead; with nothing overlapped (dp_overlap 0) a ring
    collective per parallelize unit (blocks + 1 dense, one per MoE layer's experts) of factor
    (n - 1) step latencies, at pp = 1 ddp one all-reduce (factor 2) per micro-batch, fsdp
    2m + m gathers or reduce-scatters (factor 1: FSDP2 reduces in every backward); (blocks + 1) x optimizer_overhead, and at least
    optimizer_param_overhead per local parameter. The presets keep them 0; a cluster file
    without them still loads."""
    spec, seq = _spec(), 32
    assert (_cluster().block_overhead, _cluster().collective_latency) == (0.0, 0.0)
    base = _cluster(intra_bw=1e14, intra_latency=0.0, dp_overlap=0.0)
    costs = dict(block_overhead=1e-3, moe_overhead=2e-3, step_overhead=3e-3,
                 optimizer_overhead=5e-4, collective_latency=7e-4, step_latency=7e-4,
                 block_token_overhead=1e-6, moe_token_overhead=2e-6, step_token_overhead=3e-6)  # fmt: skip
    cl = replace(base, **costs)
    blocks, moe_blocks, t = spec.n_layers, spec.moe_layers, 2 * seq
    for dp_mode, passes, factor in (("ddp", 3, 2), ("fsdp", 2 * 3 + 3, 1)):
        lay = Layout(1, 4, 1, dp_mode, microbatches=3, micro_batch_seqs=2)
        a = predict(spec, base, lay, seq, 4 * 3 * 2 * seq)
        b = predict(spec, cl, lay, seq, 4 * 3 * 2 * seq)
        fixed = blocks * (1e-3 + t * 1e-6) + moe_blocks * (2e-3 + t * 2e-6) + 3e-3 + t * 3e-6
        assert b.time["compute"] - a.time["compute"] == pytest.approx(3 * fixed)
        steps = factor * 3 * (blocks + 1 + moe_blocks)  # n - 1 = 3 ring steps per factor
        assert b.time["dp_comms"] - a.time["dp_comms"] == pytest.approx(passes * steps * 7e-4)
        assert b.time["optimizer"] - a.time["optimizer"] == pytest.approx((blocks + 1) * 5e-4)
        assert b.peak_memory == a.peak_memory
    slow = predict(spec, replace(base, optimizer_param_overhead=1e-6), lay, seq, 12 * 2 * seq)
    fast = predict(spec, base, lay, seq, 12 * 2 * seq)
    local = spec.total_params() / 4  # fsdp over 4 ranks
    assert slow.time["optimizer"] == pytest.approx(1e-6 * local)
    assert fast.time["optimizer"] < 1e-6 * local
    full = Layout(1, 4, 1, "ddp", recompute="full")
    a, b = (predict(spec, c, full, seq, 4 * seq) for c in (base, cl))
    t = seq
    per_block = blocks * (1e-3 + t * 1e-6) + moe_blocks * (2e-3 + t * 2e-6)
    assert b.time["compute"] - a.time["compute"] == pytest.approx(
        per_block * (1 + 1 / 3) + 3e-3 + t * 3e-6
    )
    assert cl.cost_model().a_coll == 7e-4
    lay = Layout(1, 4, 1, "ddp", groups=2)
    a, b = (
        predict(spec, c, lay, seq, 4 * seq) for c in (base, replace(base, optimizer_temp_bytes=4))
    )
    assert b.memory["temporaries"] == a.memory["temporaries"] / 2 > 0
    # a per-tensor step: + bytes per element of the largest tensor (8 experts x 64 x 96)
    c = predict(spec, replace(base, optimizer_tensor_temp_bytes=12), lay, seq, 4 * seq)
    assert c.memory["temporaries"] - a.memory["temporaries"] == 12 * 8 * 64 * 96
    with pytest.raises(ValueError, match="block_overhead"):
        replace(base, block_overhead=-1.0)
    with pytest.raises(ValueError, match="dp_overlap must be in"):
        replace(base, dp_overlap=1.5)
    from moe.plan.overhead import measure_overheads

    generic = measure_overheads(repeats=2, reference="generic")
    assert set(generic) == {
        "block_overhead",
        "moe_overhead",
        "step_overhead",
        "optimizer_overhead",
        "offload_overhead",
        "optimizer_temp_bytes",
        "optimizer_tensor_temp_bytes",
    }
    times = ("block_overhead", "step_overhead", "optimizer_overhead", "offload_overhead")
    assert all(generic[k] > 0 for k in times)  # measured work takes time (none clamped at 0)
    assert (generic["optimizer_temp_bytes"], generic["optimizer_tensor_temp_bytes"]) == (0, 12)
