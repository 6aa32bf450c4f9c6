"""Cluster: the machines a layout is planned for, from datasheet presets or a measured profile.

A preset's figures are vendor datasheet numbers (dense, no sparsity), clearly presets: the
achieved fraction of peak is `gemm_efficiency` (large GEMMs) with grouped expert GEMMs falling
off for few rows per expert as rows / (rows + `gemm_half_rows`); links are per GPU and per
direction. A profile (`python -m moe.plan profile`) replaces these with measured values on the
machines it ran on (`Cluster.load`), the all-to-all as the fitted moe.comm CostModel. A
profile also records fixed framework costs (block, MoE block, micro-batch, optimizer, one
collective call: moe/plan/overhead.py) that dominate tiny models on CPUs; the presets keep 0.
The all-to-all's per-call cost a_coll is the larger of the intra-node latency and the
measured collective latency.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from moe.comm.cost_model import CostModel, check_physical_ranges
from moe.settings import check_path
from moe.untrusted import read_json

GB = 1e9
GiB = 2**30
CLUSTER_VERSION = 1
_MAX_CLUSTER_BYTES = 1 << 16


@dataclass(frozen=True)
class Cluster:
    """nodes x gpus_per_node devices of `device_memory_gib` each. TFLOP/s per device (dense
    peak) by dtype, HBM and host-link bandwidths (bytes/s), and the links: per-GPU bandwidth
    (bytes/s, one direction) and per-message latency (s) inside a node and across nodes."""

    nodes: int
    gpus_per_node: int
    device_memory_gib: float
    tflops_bf16: float
    tflops_fp8: float
    hbm_bw: float
    host_bw: float  # device <-> host (PCIe), for offload
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    gemm_efficiency: float = 0.6
    gemm_half_rows: float = 128.0
    # achieved FP8 GEMM rate over the FP8 peak, relative to bf16's gemm_efficiency: Hopper's
    # grouped FP8 GEMMs reach 1.0-1.3x bf16's rate, not the datasheet's 2x (torchao, Megatron;
    # the weight gradient ~30% of peak): 0.65 x 2 = 1.3x bf16, the top of that range, for all
    # three expert GEMMs (moe's weight gradients read e4m3 codes too; not yet timed on a GPU)
    fp8_gemm_efficiency: float = 0.65
    # fixed framework costs, measured by the profile (0 in the presets: a GPU step at the
    # presets' sizes is bound by its GEMMs and links); seconds, see moe/plan/overhead.py
    block_overhead: float = 0.0  # per block and micro-batch, forward + backward
    moe_overhead: float = 0.0  # extra per MoE block and micro-batch (router, permutation)
    step_overhead: float = 0.0  # per micro-batch: embedding, head and loss
    optimizer_overhead: float = 0.0  # per block and step: the optimizer's per-tensor work
    # per token of a micro-batch, beyond the GEMMs (norms, rotary, softmax, casts)
    block_token_overhead: float = 0.0
    moe_token_overhead: float = 0.0
    step_token_overhead: float = 0.0
    optimizer_param_overhead: float = 0.0  # seconds per parameter of an optimizer step, if more
    # than its bytes over hbm_bw
    offload_overhead: float = 0.0  # optimizer_overhead of an offloaded step (host tensors)
    offload_param_overhead: float = 0.0  # seconds per parameter of an offloaded step, if more
    # than its bytes over host_bw
    collective_latency: float = 0.0  # per collective call (all-to-all, gather, reduce)
    # per ring step of a data-parallel collective (an all-reduce of n ranks takes 2 (n - 1)
    # steps, a gather or reduce-scatter n - 1): the profile's fit of a world all-reduce's time
    # against its size; the presets keep 0 (the links' latency)
    step_latency: float = 0.0
    dp_overlap: float = 1.0  # the share of data-parallel traffic that can run under compute
    # one all-reduce ("ddp") / all-gather or reduce-scatter ("fsdp") of a parallelize unit over
    # the world as FSDP2 issues it, waiting for the other ranks included (a CPU profile)
    ddp_call_latency: float = 0.0
    fsdp_call_latency: float = 0.0
    # per MoE block and micro-batch under expert parallelism, beyond the all-to-all model:
    # the count exchange, the permutations around the exchanges (a CPU profile)
    ep_overhead: float = 0.0
    optimizer_temp_bytes: float = 8.0  # per parameter, the optimizer step's temporaries
    # ranks of a node that share one inter-node link (1: a NIC per GPU, as in the presets'
    # nodes); the profile measures it (all of a node's ranks sending across at once against
    # one alone): concurrent traffic across nodes divides inter_bw among them
    nic_ranks: int = 1
    # FSDP units gathered at once: 2 where the CPU thread runs ahead of the device and issues
    # the next unit's all-gather (on its own CUDA stream) under the current unit's compute;
    # 1 where ops run synchronously (a CPU profile sets it)
    fsdp_gathered_units: int = 2
    # a reduce-scatter's time over an all-gather's of the same bytes (1: NCCL's rings; gloo
    # all-reduces the whole input, about 2); the profile measures it over the world
    reduce_scatter_factor: float = 1.0
    optimizer_tensor_temp_bytes: float = 0.0  # per element of the largest tensor (per-tensor step)
    name: str = "custom"
    source: str = "datasheet preset"

    def __post_init__(self) -> None:
        ints = ("nodes", "gpus_per_node", "nic_ranks", "fsdp_gathered_units")
        for f in ints:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Cluster.{f} must be an int >= 1, got {v!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in (*ints, "name", "source"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Cluster.{f.name} must be a finite number, got {v!r}")
            zero_ok = f.name.endswith(("latency", "overhead", "bytes")) or f.name == "dp_overlap"
            if v < 0 or (v == 0 and not zero_ok):
                raise ValueError(f"Cluster.{f.name} must be > 0, got {v!r}")
        if self.reduce_scatter_factor < 1:
            raise ValueError(
                f"Cluster.reduce_scatter_factor must be >= 1, got {self.reduce_scatter_factor}"
            )
        if self.dp_overlap > 1:
            raise ValueError(f"Cluster.dp_overlap must be in [0, 1], got {self.dp_overlap}")
        for name in ("gemm_efficiency", "fp8_gemm_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Cluster.{name} must be in (0, 1], got {getattr(self, name)}")
        self.cost_model()  # the links' figures in their physical ranges

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def device_memory_bytes(self) -> int:
        return int(self.device_memory_gib * GiB)

    def flops(self, fp8: bool = False) -> float:
        return (self.tflops_fp8 if fp8 else self.tflops_bf16) * 1e12

    def gemm_rate(self, rows: float, fp8: bool = False) -> float:
        """Achieved FLOP/s of GEMMs with `rows` rows (per expert, for grouped ones)."""
        efficiency = self.gemm_efficiency * (self.fp8_gemm_efficiency if fp8 else 1.0)
        return self.flops(fp8) * efficiency * rows / (rows + self.gemm_half_rows)

    def cost_model(self) -> CostModel:
        """The all-to-all's alpha-beta model from the links (moe.comm.cost_model's form); all
        of a node's ranks exchange at once, so a shared inter-node link divides its bandwidth."""
        values = dict(
            a_coll=max(self.intra_latency, self.collective_latency),
            a_intra=self.intra_latency,
            bw_intra=self.intra_bw,
            a_inter=self.inter_latency,
            bw_inter=self.inter_bw / self.sharing(self.gpus_per_node),
            bw_copy=self.hbm_bw / 2,
            a_ring=self.inter_latency,
        )
        check_physical_ranges(values)
        return CostModel(**values)

    def sharing(self, senders: int) -> int:
        """How many ranks' traffic one inter-node link carries when `senders` ranks of each
        node send across at once (an all-to-all: all of them)."""
        return max(1, min(senders, self.nic_ranks, self.gpus_per_node))

    def link(self, ranks: int, span_nodes: bool, senders: int = 1) -> tuple[float, float]:
        """(bandwidth, latency) of a group of `ranks` ranks: across nodes when it spans them
        (span_nodes), shared by `senders` ranks of each node sending across at once (groups
        side by side), else NVLink-class."""
        if span_nodes and ranks > 1:
            return self.inter_bw / self.sharing(senders), self.inter_latency
        return self.intra_bw, self.intra_latency

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"version": CLUSTER_VERSION, **asdict(self)}, indent=1))

    @staticmethod
    def load(path: str | Path) -> Cluster:
        """A cluster file (a profile or a saved preset): untrusted JSON, every field checked."""
        check_path("cluster file", str(path))
        doc = read_json(path, max_bytes=_MAX_CLUSTER_BYTES, what="cluster file")
        if not isinstance(doc, dict) or doc.get("version") != CLUSTER_VERSION:
            raise ValueError(f"{path}: not a moe.plan cluster file (version {CLUSTER_VERSION})")
        names = {f.name for f in fields(Cluster)}
        unknown = sorted(set(doc) - names - {"version"})
        if unknown:
            raise ValueError(f"{path}: unknown cluster fields {unknown}")
        missing = sorted(
            f.name for f in fields(Cluster) if f.name not in doc and f.default is MISSING
        )
        if missing:
            raise ValueError(f"{path}: cluster fields missing: {missing}")
        return Cluster(**{k: v for k, v in doc.items() if k != "version"})

    def with_nodes(self, nodes: int, gpus_per_node: int | None = None) -> Cluster:
        return replace(self, nodes=nodes, gpus_per_node=gpus_per_node or self.gpus_per_node)


def _node(name, tflops_bf16, mem_gib, hbm_tbs, nvlink_gbs, ib_gbs, **kw) -> Cluster:
    return Cluster(
        nodes=1,
        gpus_per_node=8,
        device_memory_gib=mem_gib,
        tflops_bf16=tflops_bf16,
        tflops_fp8=2 * tflops_bf16,
        hbm_bw=hbm_tbs * 1e12,
        host_bw=kw.pop("host_gbs", 55) * GB,
        intra_bw=nvlink_gbs * GB,
        intra_latency=3e-6,
        inter_bw=ib_gbs * GB,
        inter_latency=10e-6,
        name=name,
        source="datasheet preset (NVIDIA dense peak; links per GPU, one direction)",
        **kw,
    )


# 8-GPU nodes: NVLink bandwidth per GPU per direction (H100/H200 NVLink 4: 900 GB/s both ways;
# H800: 400 GB/s both ways; B200 NVLink 5: 1.8 TB/s), one 400 Gb/s NIC per GPU (50 GB/s).
PRESETS: dict[str, Cluster] = {
    "h100": _node("h100", 989, 80, 3.35, 450, 50),
    "h800": _node("h800", 989, 80, 3.35, 200, 50),
    "h200": _node("h200", 989, 141, 4.8, 450, 50),
    "b200": _node("b200", 2250, 180, 8.0, 900, 50),
}


def preset(name: str, nodes: int = 1, gpus_per_node: int | None = None, **changes) -> Cluster:
    """A datasheet preset scaled to `nodes` (unknown names: one error listing the presets)."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}: one of {', '.join(PRESETS)}")
    return replace(PRESETS[name].with_nodes(nodes, gpus_per_node), **changes)
