"""Predicted per-device peak memory (by category) and step time (by term) of one Layout.

Per pp rank (the slowest and the fullest rank are reported), with t = tokens per micro-batch
(micro_batch_seqs x seq_len), m micro-batches, its chunks' parameters P (dense) and X
(routed experts, x (E + spare) / E), bf16 weights with fp32 masters and Adam:
  memory  parameters  2 B x (P / s_d + X / (ep s_e)) (fsdp: s_d = dp ep, s_e = dp; ddp:
                      s_d = s_e = 1); gradients 2 B x the local parameters;
          optimizer   12 B / local parameter (master + 2 moments); offload "optimizer" keeps
                      the 4 B masters, "all" nothing; temporaries cluster.optimizer_temp_bytes
                      (8 B in the presets, measured by a profile) x local / groups +
                      optimizer_tensor_temp_bytes (0 in the presets) x the rank's largest
                      tensor (an optimizer stepping tensor by tensor, torch's CPU default)
          activations per micro-batch t x (saved bytes per token of the rank's chunks, by
                      recompute) x micro-batches in flight (GPipe m; 1F1B min(m, p - r);
                      interleaved min(m v, 2 (p - r - 1) + (v - 1) p + 1) / v chunk units;
                      ZBV min(m, p); DualPipeV min(m, p + 1)); full recompute keeps block
                      inputs plus one block's activations
          comms       all-to-all send + receive 2 t k c h (1 B / element for FP8 dispatch,
                      x2 hierarchical); stage p2p 2 t h per chunk; one parallelize unit's
                      gradients (FSDP2 reduces unit by unit, replicate ("ddp") too);
                      cluster.fsdp_gathered_units gathered FSDP units (2 on GPUs, 1 on a
                      CPU); with pp > 1 and m > 1 instead the unsharded
                      gradients 2 B x (P + X / ep) a stage accumulates until its last
                      micro-batch's sync, fsdp's gathered parameters as much again
          peak        parameters + gradients + optimizer + the larger phase: activations +
                      comms (forward / backward) or temporaries (the optimizer step)
  time    compute     FLOPs / cluster.gemm_rate: dense GEMMs at t rows, expert GEMMs at
                      t k c ep / E rows per expert (x the busiest rank's routing imbalance);
                      x3 (forward + backward), + a forward for full recompute, + the routed
                      experts' forward for MoE recompute; + per micro-batch the profile's
                      fixed costs: blocks x (block_overhead + t block_token_overhead) + MoE
                      blocks x (moe_overhead + t moe_token_overhead + ep_overhead where
                      ep > 1) (x (1 + recomputed forward share / 3)) + step_overhead + t
                      step_token_overhead (moe/plan/overhead.py)
          all-to-all  moe.comm CostModel (flat or hierarchical; a node's ranks share its
                      inter-node link where cluster.nic_ranks > 1) of 4 exchanges per MoE block
                      and micro-batch (6 recomputed); overlap degree o hides (o - 1) / o of it
                      behind the routed experts' compute
          dp comms    ring collectives, one per parallelize unit (blocks + 1 over dp ep ranks,
                      each MoE layer's experts over dp) and pass, each of factor (n - 1) steps
                      of max(link latency, cluster.step_latency, the profile's ddp / fsdp
                      call over its world's ring steps) (all-reduce factor 2, gather 1,
                      reduce-scatter cluster.reduce_scatter_factor); the experts' groups
                      (stride ep) cross between nodes side by side, sharing a link where
                      cluster.nic_ranks > 1: fsdp all-gathers forward and backward per
                      micro-batch and a reduce-scatter per gradient sync, overlapped with
                      compute beyond one unit; ddp an all-reduce per sync, overlapped with its
                      micro-batch's backward except a tenth (the last bucket); a sync per
                      micro-batch at pp = 1 (FSDP2 reduces in every backward: measured 3 calls
                      per micro-batch), one a step at pp > 1 (torch's pipelining turns the
                      sync off until the last micro-batch); of what could
                      overlap, cluster.dp_overlap does (1 in the presets)
          bubble      (p - 1) / v micro-batch times of the rank x the schedule's factor (1; 1/3
                      for ZB-H1-like InterleavedZeroBubble; 0 for ZBV and DualPipeV, their ideal
                      (Qi et al. 2024; DeepSeek-V3 report) when m >= 2p)
          p2p         2 (p - 1) sends of t h bf16 on the critical path + a latency each per
                      micro-batch and chunk (a stage's dp ep ranks send side by side)
          optimizer   32 B per local parameter over HBM; offload: 4 B over the host link and
                      the host's Adam at the same 32 B per parameter over the host link's rate;
                      at least cluster.optimizer_param_overhead (offload_param_overhead) per
                      parameter (a profile's measured step); + (blocks + 1) x
                      optimizer_overhead (offload_overhead) (per-tensor work)
  fp8         GEMMs at the FP8 rate, the quantization passes' bytes at hbm_bw (in compute),
              the dispatch payload and the experts' saved inputs in e4m3: moe/plan/fp8.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe.pipeline.config import schedule_style
from moe.plan.cluster import Cluster
from moe.plan.fp8 import FP8_ROW_BYTES, activation_saving, quantize_seconds
from moe.plan.layout import Layout
from moe.plan.skew import imbalance
from moe.plan.spec import ModelSpec
from moe.plan.stages import ACT_BYTES, rank_sums

BUBBLE_FACTOR = {"none": 0.0, "GPipe": 1.0, "1F1B": 1.0, "Interleaved1F1B": 1.0,
                 "InterleavedZeroBubble": 1 / 3, "ZBVZeroBubble": 0.0, "DualPipeV": 0.0}  # fmt: skip
OPT_BYTES_PER_PARAM = 32
MEMORY_TERMS = ("parameters", "gradients", "optimizer", "temporaries", "activations", "comms")
TIME_TERMS = ("compute", "all_to_all", "dp_comms", "bubble", "p2p", "optimizer", "offload")


def peak_of(memory: dict[str, float]) -> float:
    """The step's peak from its terms: the resident weights, gradients and optimizer state,
    plus the larger of the two phases that never overlap: forward / backward (activations and
    communication buffers) and the optimizer step (its temporaries), which runs after the
    last backward has freed the activations."""
    resident = memory["parameters"] + memory["gradients"] + memory["optimizer"]
    return resident + max(memory["temporaries"], memory["activations"] + memory["comms"])


@dataclass
class Prediction:
    layout: Layout
    memory: dict[str, float]  # bytes per device, the fullest rank
    time: dict[str, float]  # seconds per step, the slowest rank
    tokens_per_s_per_device: float
    mfu: float
    device_memory: float
    notes: list[str] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)  # routed_gemm, quantize (seconds)

    @property
    def peak_memory(self) -> float:
        return peak_of(self.memory)

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.device_memory

    def record(self) -> dict:
        return {
            "layout": self.layout.record(),
            "memory": self.memory,
            "peak_memory": self.peak_memory,
            "time": self.time,
            "step_time": self.step_time,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu,
            "fits": self.fits,
            "notes": self.notes,
        }


def in_flight(schedule: str, m: int, p: int, v: int, r: int) -> float:
    """Micro-batches whose activations pp rank r holds at its peak (in units of all its
    chunks' activations of one micro-batch)."""
    if schedule == "none":
        return 1.0
    if schedule == "GPipe":
        return float(m)
    if schedule_style(schedule) == "loop":
        return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) / v
    if schedule == "DualPipeV":
        return float(min(m, p + 1))
    if schedule == "ZBVZeroBubble":
        return float(min(m, p))
    return float(min(m, p - r))


def _group_link(cluster: Cluster, ranks: int, stride_span: int, side_by_side: int = 1):
    """(bandwidth, latency) of a group of `ranks` ranks within a block of `stride_span`
    consecutive ranks, `side_by_side` such groups interleaved in it (a stride of that many
    ranks: their rings cross between nodes at once)."""
    return cluster.link(ranks, stride_span > cluster.gpus_per_node, side_by_side)


def _collective(nbytes: float, ranks: int, bw: float, lat: float, factor: float, calls=1) -> float:
    """Ring collectives over `ranks` moving nbytes in all, in `calls` calls: each call takes
    factor x (n - 1) steps of latency `lat` (an all-reduce, factor 2, is a reduce-scatter and a
    gather), and the bytes take factor x nbytes x (n - 1) / n / bw."""
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) * (nbytes / ranks / bw + calls * lat)


def _largest_tensor(spec: ModelSpec, chunk, L: Layout) -> float:
    """Elements of the rank's largest parameter tensor: the embedding or head (V d), the MoE
    layer's routed experts' gate and up projections stacked ((2 if gated) E / ep d f), or a
    dense FFN's (2 if gated) d f; fsdp shards it over its unit's ranks."""
    g = 2 if spec.gated else 1
    vd = spec.vocab_size * spec.d_model
    ends = vd if chunk.dense_params >= vd else 0  # the rank holds the embedding or head
    experts = (
        g * spec.num_experts / L.ep * spec.d_model * spec.d_ff_expert if chunk.moe_blocks else 0
    )
    dense = g * spec.d_model * spec.d_ff_dense if chunk.blocks > chunk.moe_blocks else 0
    if L.data_parallel == "fsdp":
        ends, dense, experts = ends / (L.dp * L.ep), dense / (L.dp * L.ep), experts / L.dp
    return max(ends, experts, dense, 0.0)


@dataclass(frozen=True)
class _Setup:
    """What every pp rank of one layout shares."""

    spec: ModelSpec
    cluster: Cluster
    L: Layout
    t: int  # tokens per micro-batch
    cf: float
    imb: float  # the busiest EP rank's routing imbalance
    spare: float  # (E + spare slots) / E
    a2a_bytes: float  # one exchange's elements per rank

    def exchange(self, nbytes: float) -> float:
        L, c = self.L, self.cluster
        if L.ep <= 1:
            return 0.0
        nodes, per_node = max(1, math.ceil(L.ep / c.gpus_per_node)), min(L.ep, c.gpus_per_node)
        cm = c.cost_model()
        if L.exchange == "hierarchical":
            return cm.hier_time(nbytes, nodes, per_node)
        return cm.flat_time(nbytes, nodes, per_node)


def predict(
    spec: ModelSpec,
    cluster: Cluster,
    layout: Layout,
    seq_len: int,
    global_batch_tokens: int,
    load: list[float] | None = None,
) -> Prediction:
    """The Prediction of `layout` (checked by moe.plan.search, not here)."""
    L = layout
    cf = L.capacity_factor or 1.0
    t = L.micro_batch_seqs * seq_len
    imb = imbalance(load, L.ep, L.replicas) if load is not None else 1.0
    setup = _Setup(spec, cluster, L, t, cf, imb, (spec.num_experts + L.replicas) / spec.num_experts,
                   t * spec.top_k * cf * spec.d_model)  # fmt: skip
    spare = L.replicas if L.split == "params" else 0  # the slots count in a "params" split only
    sums = rank_sums(spec, seq_len, L.pp, L.pipeline, L.capacity_factor, spare)
    per_rank = [_rank(setup, sums[r], r) for r in range(L.pp)]
    memory = max((mem for mem, _, _ in per_rank), key=peak_of)
    times, parts = max(((tm, pt) for _, tm, pt in per_rank), key=lambda x: sum(x[0].values()))
    step = sum(times.values())
    model_flops = 3 * sum(x.dense_flops + x.routed_flops * cf for x in sums) * global_batch_tokens
    return Prediction(
        layout=L,
        memory=memory,
        time=times,
        tokens_per_s_per_device=global_batch_tokens / step / L.world,
        mfu=model_flops / (step * L.world * cluster.flops()),
        device_memory=cluster.device_memory_bytes,
        parts=parts,
    )


def _shards(S: _Setup, mine) -> tuple[float, float, float, float]:
    """(dense, expert parameters of the rank's chunks, local parameters, the FSDP unit)."""
    L = S.L
    P, X = mine.dense_params, mine.expert_params * S.spare
    fsdp = L.data_parallel == "fsdp"
    local = P / (L.dp * L.ep) + X / (L.ep * L.dp) if fsdp else P + X / L.ep
    unit = 0.0  # the largest parallelize unit (a block's dense part or a layer's experts)
    if mine.blocks:
        unit = max(P / max(mine.blocks, 1), X / max(mine.moe_blocks, 1) / L.ep)
    return P, X, local, unit


def _rank(S: _Setup, mine, r: int) -> tuple[dict, dict, dict]:
    """(memory by category, time by term, parts) of pp rank r holding `mine`."""
    return _rank_memory(S, mine, r), *_rank_time(S, mine)


def _rank_memory(S: _Setup, mine, r: int) -> dict:
    spec, cluster, L, t = S.spec, S.cluster, S.L, S.t
    P, X, local, unit = _shards(S, mine)
    memory = {
        "parameters": 2 * local,
        "gradients": 2 * local,
        "optimizer": {None: 12, "optimizer": 4, "all": 0}[L.offload] * local,
        "temporaries": 0.0
        if L.offload
        else cluster.optimizer_temp_bytes * local / L.groups
        + cluster.optimizer_tensor_temp_bytes * _largest_tensor(spec, mine, L),
    }
    act_tok = mine.act
    if L.recompute == "moe":
        act_tok = mine.act_moe_recompute
    elif L.recompute == "full":
        act_tok = mine.act_input
    elif L.recompute.startswith("blocks:"):
        n = min(int(L.recompute.split(":")[1]), mine.blocks)
        act_tok -= n * (mine.act - mine.act_input) / max(mine.blocks, 1)
    if L.fp8_experts and L.recompute not in ("moe", "full"):  # moe/plan/fp8.py
        kept = 1 - min(L.recompute_blocks or 0, mine.blocks) / max(mine.blocks, 1)
        act_tok -= kept * mine.moe_blocks * activation_saving(spec, S.cf)
    head = mine.head_act * t  # the loss's logits, one micro-batch
    transient = mine.act_block_max * t if L.recompute != "none" else 0.0
    flight = in_flight(L.schedule, L.microbatches, L.pp, L.stages_per_rank, r)
    memory["activations"] = act_tok * t * flight + head + transient
    comms = 0.0
    if L.ep > 1 and mine.moe_blocks:
        elem = FP8_ROW_BYTES if L.fp8_dispatch else ACT_BYTES
        comms += 2 * S.a2a_bytes * elem * (2 if L.exchange == "hierarchical" else 1)
    if L.pp > 1:
        comms += 2 * t * spec.d_model * ACT_BYTES * mine.chunks
    if L.dp * L.ep > 1:  # one unit's gradients in flight (fsdp reduce-scatter, ddp all-reduce)
        comms += 2 * unit
    memory["comms"] = comms + _held_for_backward(S, P, X, unit)
    return memory


def _held_for_backward(S: _Setup, P: float, X: float, unit: float) -> float:
    """Bytes FSDP2 holds through forward and backward only (freed before the optimizer step).
    A pipeline stage (torch's pipelining, on FSDP2 modules) skips the gradient sync of all
    but its last micro-batch: the rank accumulates its chunks' gradients unsharded (2 B x P +
    X / ep), and fsdp keeps their parameters gathered until that last backward. Otherwise fsdp
    holds cluster.fsdp_gathered_units units gathered (2 on GPUs, where the next unit's
    gather runs ahead on its own stream)."""
    L, fsdp = S.L, S.L.data_parallel == "fsdp"
    if L.pp > 1 and L.microbatches > 1 and L.dp * L.ep > 1:
        unsharded = P + X / L.ep
        return 2 * unsharded * (2 if fsdp else 1)
    return 2 * unit * S.cluster.fsdp_gathered_units if fsdp else 0.0


def _rank_time(S: _Setup, mine) -> tuple[dict, dict]:
    spec, cluster, L, t = S.spec, S.cluster, S.L, S.t
    m, p, v = L.microbatches, L.pp, L.stages_per_rank
    P, X, local, _ = _shards(S, mine)
    blocks, moe_blocks = mine.blocks, mine.moe_blocks
    rows_per_expert = max(t * spec.top_k * S.cf * L.ep / spec.num_experts * S.imb, 1.0)
    fwd_dense = mine.dense_flops * t / cluster.gemm_rate(t)
    fwd_routed = (
        mine.routed_flops * t * S.cf * S.imb / cluster.gemm_rate(rows_per_expert, fp8=L.fp8_experts)
    )
    fwd = fwd_dense + fwd_routed
    extra = {"none": 0.0, "moe": fwd_routed, "full": fwd}.get(L.recompute, 0.0)
    if L.recompute.startswith("blocks:"):
        extra = fwd * min(int(L.recompute.split(":")[1]), blocks) / max(blocks, 1)
    recomputed = extra / fwd if fwd else 0.0  # the share of a forward run again
    fixed = blocks * (cluster.block_overhead + t * cluster.block_token_overhead)
    fixed += moe_blocks * (cluster.moe_overhead + t * cluster.moe_token_overhead)
    fixed += moe_blocks * cluster.ep_overhead if L.ep > 1 else 0.0
    fixed = fixed * (1 + recomputed / 3) + cluster.step_overhead + t * cluster.step_token_overhead
    quantize, per_step = quantize_seconds(S, mine, recomputed)  # FP8's passes (moe/plan/fp8.py)
    per_mb = 3 * fwd + extra + fixed + quantize
    compute = m * per_mb + per_step
    routed = m * (3 * fwd_routed + (extra * fwd_routed / fwd if fwd else 0.0))
    exchanges = 4 + (2 if L.recompute != "none" else 0)
    send = S.exchange(S.a2a_bytes * (FP8_ROW_BYTES if L.fp8_dispatch else ACT_BYTES))
    plain = S.exchange(S.a2a_bytes * ACT_BYTES)
    a2a = m * moe_blocks * (send + (exchanges - 1) * plain)
    hidden = min(a2a * (L.overlap - 1) / L.overlap, m * 3 * fwd_routed)
    return {
        "compute": compute,
        "all_to_all": a2a - hidden,
        "dp_comms": _dp_comms(S, P, X, blocks, moe_blocks, compute, fwd),
        "bubble": BUBBLE_FACTOR[L.schedule] * (p - 1) / v * per_mb,
        "p2p": _p2p(S),
        **_optimizer_terms(S, local, blocks),
    }, {"routed_gemm": routed, "quantize": m * quantize + per_step}


def _dp_comms(S: _Setup, P, X, blocks, moe_blocks, compute: float, fwd: float) -> float:
    """Exposed FSDP gathers / reduce-scatters or DDP all-reduce: one collective per
    parallelize unit (each block and the root over dp x ep ranks, each MoE layer's experts
    over dp) and pass, each ring step at least the profile's step_latency; of the traffic that
    could hide under compute, cluster.dp_overlap does."""
    cluster, L, m = S.cluster, S.L, S.L.microbatches
    dense_bw, dense_lat = _group_link(cluster, L.dp * L.ep, L.dp * L.ep)
    exp_bw, exp_lat = _group_link(cluster, L.dp, L.dp * L.ep, L.ep)
    W, fsdp = max(cluster.world - 1, 1), L.data_parallel == "fsdp"
    call = cluster.fsdp_call_latency / W if fsdp else cluster.ddp_call_latency / (2 * W)
    step = max(cluster.step_latency, call)  # a ring step, from the profile's world collectives
    dense_lat, exp_lat = max(dense_lat, step), max(exp_lat, step)
    dense, experts = (
        (2 * P, L.dp * L.ep, dense_bw, dense_lat),
        (2 * X / L.ep, L.dp, exp_bw, exp_lat),
    )
    syncs = m if L.pp == 1 else 1  # gradient syncs a step: at pp = 1 every backward (FSDP2)
    if fsdp:
        gather = _collective(*dense, 1, blocks + 1) + _collective(*experts, 1, moe_blocks)
        # gathers per micro-batch, a reduce-scatter per sync
        total = (2 * m + syncs * cluster.reduce_scatter_factor) * gather
        units = 2 * m * max(blocks, 1) + syncs
        return _exposed(cluster, total, max(0.0, total - compute) + total / units)
    reduce = _collective(*dense, 2, blocks + 1) + _collective(*experts, 2, moe_blocks)
    return _exposed(cluster, syncs * reduce, syncs * (max(0.0, reduce - 2 * fwd) + reduce / 10))


def _exposed(cluster: Cluster, total: float, overlapped: float) -> float:
    """The exposed share of `total` traffic: `overlapped` where it runs fully under compute,
    all of it where nothing does, in between by cluster.dp_overlap."""
    return cluster.dp_overlap * overlapped + (1 - cluster.dp_overlap) * total


def _p2p(S: _Setup) -> float:
    L = S.L
    if L.pp <= 1:
        return 0.0
    bw, lat = _group_link(S.cluster, 2, 2 * L.dp * L.ep, L.dp * L.ep)
    one = lat + S.t * S.spec.d_model * ACT_BYTES / bw
    return 2 * (L.pp - 1) * one + 2 * L.microbatches * L.stages_per_rank * lat


def _optimizer_terms(S: _Setup, local: float, blocks: int) -> dict:
    """The step's seconds: bytes over the memory (or host link) bandwidth, or a profile's
    measured seconds per parameter where more, + (blocks + 1) per-tensor fixed costs."""
    c = S.cluster
    if S.L.offload:
        per_param = max((4 + OPT_BYTES_PER_PARAM) / c.host_bw, c.offload_param_overhead)
        return {"optimizer": 0.0, "offload": local * per_param + (blocks + 1) * c.offload_overhead}
    per_param = max(OPT_BYTES_PER_PARAM / c.hbm_bw, c.optimizer_param_overhead)
    return {"optimizer": local * per_param + (blocks + 1) * c.optimizer_overhead, "offload": 0.0}
