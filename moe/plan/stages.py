"""The model cut into pipeline chunks (pp x stages_per_rank of them) exactly as moe.pipeline
cuts it: the stack (embedding, each block, head) split by moe.pipeline.split.stage_sizes and
the chunks placed on pp ranks by PipelineConfig.stage_ranks (the pipeline's own functions),
each chunk summarised once per (model, sequence length, split): parameters, FLOPs and saved
activations per token. Activations are moe.memory.activations' per-block formula (Korthikanti et
al. 2022, flash attention, no dropout, bf16), linear in tokens at a fixed sequence length."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

from moe.memory.activations import block_activation_bytes
from moe.pipeline.config import PipelineConfig
from moe.pipeline.split import stage_sizes
from moe.plan.spec import ModelSpec

ACT_BYTES = 2  # bf16 activations


@dataclass(frozen=True)
class Chunk:
    """One pipeline chunk's blocks [first, first + blocks) (and the embedding / head)."""

    first: int
    blocks: int
    moe_blocks: int
    dense_params: int  # everything but routed experts (embedding / head included)
    expert_params: int  # routed experts, all E of them
    dense_flops: float  # forward FLOPs per token outside the routed experts
    routed_flops: float  # forward FLOPs per token in the routed experts (top_k of E)
    act: float  # saved activations per token, no recompute
    act_moe_recompute: float  # MoE FFNs recomputed: they keep only their input
    act_input: float  # per token, the blocks' inputs only (full recompute)
    act_block_max: float  # the largest single block's activations per token
    head_act: float  # logits (bf16 + fp32 log-softmax) per token on the last chunk
    has_embed: bool
    has_head: bool


def _shim(spec: ModelSpec, seq_len: int, d_ff: int, cf: float | None) -> SimpleNamespace:
    return SimpleNamespace(
        seq_len=seq_len,
        d_model=spec.d_model,
        n_heads=spec.n_heads,
        d_ff=d_ff,
        top_k=spec.top_k,
        capacity_factor=cf,
        num_experts=spec.num_experts,
        activation="swiglu" if spec.gated else "gelu",
    )


def _per_token(cfg, moe: bool) -> float:
    return block_activation_bytes(cfg, cfg.seq_len, moe, ACT_BYTES, True, False) / cfg.seq_len


def stack_weights(spec: ModelSpec, spare_slots: int = 0) -> list[int]:
    """Parameters of each child of the stack the pipeline splits: the embedding, each block
    (its routed experts in E + spare_slots slots, as built), the head."""
    slots = spare_slots * spec.expert_params()
    blocks = [d + e + (slots if e else 0) for d, e in map(spec.layer_params, range(spec.n_layers))]
    return [spec.embedding_params(), *blocks, spec.head_params()]


def block_split(
    spec: ModelSpec, n_chunks: int, split: str = "children", spare_slots: int = 0
) -> list[tuple[int, int, bool, bool]]:
    """(first block, block count, holds the embedding, holds the head) of each chunk, by the
    pipeline's own rule (moe.pipeline.split.stage_sizes) over the stack's children."""
    sizes = stage_sizes(stack_weights(spec, spare_slots), n_chunks, split)
    out, start, last = [], 0, spec.n_layers + 1  # child 0: embedding; last: head
    for n in sizes:
        first, end = max(start - 1, 0), min(start + n - 1, spec.n_layers)
        out.append((first, max(end - first, 0), start == 0, start + n - 1 == last))
        start += n
    return out


@functools.lru_cache(maxsize=4096)
def chunks(
    spec: ModelSpec,
    seq_len: int,
    n_chunks: int,
    cf: float | None,
    split: str = "children",
    spare_slots: int = 0,
) -> tuple[Chunk, ...]:
    """The model's n_chunks pipeline chunks."""
    moe_cfg = _shim(spec, seq_len, spec.d_ff_expert, cf)
    dense_cfg = _shim(spec, seq_len, spec.d_ff_dense, cf)
    bare_cfg = _shim(spec, seq_len, 0, cf)  # attention + norms + the FFN input
    shared_tok = (4 if spec.gated else 2) * spec.shared_d_ff * ACT_BYTES / 2 + 2 * spec.d_model
    act_moe = _per_token(moe_cfg, True) + (shared_tok if spec.shared_d_ff else 0)
    act_dense = _per_token(dense_cfg, False)
    act_bare = _per_token(bare_cfg, False)
    out = []
    for first, n, has_embed, has_head in block_split(spec, n_chunks, split, spare_slots):
        dense = experts = moe_blocks = 0
        dflops = rflops = act = act_mr = biggest = 0.0
        for i in range(first, first + n):
            d, e = spec.layer_params(i)
            f_dense, f_routed = spec.layer_flops(i, seq_len)
            dense, experts, dflops, rflops = (
                dense + d,
                experts + e,
                dflops + f_dense,
                rflops + f_routed,
            )
            block = act_moe if spec.is_moe(i) else act_dense
            moe_blocks += spec.is_moe(i)
            act += block
            act_mr += act_bare if spec.is_moe(i) else act_dense
            biggest = max(biggest, block)
        if has_embed:
            dense += spec.embedding_params()
        if has_head:
            dense += spec.head_params()
            dflops += spec.head_flops()
        out.append(
            Chunk(
                first=first,
                blocks=n,
                moe_blocks=moe_blocks,
                dense_params=dense,
                expert_params=experts,
                dense_flops=dflops,
                routed_flops=rflops,
                act=act,
                act_moe_recompute=act_mr,
                act_input=n * spec.d_model * ACT_BYTES,
                act_block_max=biggest,
                head_act=spec.vocab_size * (ACT_BYTES + 4) if has_head else 0.0,
                has_embed=has_embed,
                has_head=has_head,
            )
        )
    return tuple(out)


def rank_chunks(pp: int, pipeline: PipelineConfig | None) -> list[list[int]]:
    """The chunks each pp rank holds, as PipelineConfig.stage_ranks places them (pp = 1: one)."""
    owners = [0] if pipeline is None else pipeline.stage_ranks(pp)
    return [[c for c, owner in enumerate(owners) if owner == r] for r in range(pp)]


@dataclass(frozen=True)
class RankSums:
    """The sums over the chunks one pp rank holds (see Chunk)."""

    chunks: int
    blocks: int
    moe_blocks: int
    dense_params: int
    expert_params: int
    dense_flops: float
    routed_flops: float
    act: float
    act_moe_recompute: float
    act_input: float
    act_block_max: float
    head_act: float


@functools.lru_cache(maxsize=4096)
def rank_sums(
    spec: ModelSpec,
    seq_len: int,
    pp: int,
    pipeline: PipelineConfig | None,
    cf: float | None,
    spare_slots: int = 0,
) -> tuple[RankSums, ...]:
    """Per pp rank, the sums over its chunks (cached: the search asks for each many times)."""
    owned = rank_chunks(pp, pipeline)
    split = "children" if pipeline is None else pipeline.split
    parts = chunks(spec, seq_len, sum(map(len, owned)), cf, split, spare_slots)
    out = []
    for mine in ([parts[c] for c in chunks_of] for chunks_of in owned):
        out.append(
            RankSums(
                chunks=len(mine),
                blocks=sum(c.blocks for c in mine),
                moe_blocks=sum(c.moe_blocks for c in mine),
                dense_params=sum(c.dense_params for c in mine),
                expert_params=sum(c.expert_params for c in mine),
                dense_flops=sum(c.dense_flops for c in mine),
                routed_flops=sum(c.routed_flops for c in mine),
                act=sum(c.act for c in mine),
                act_moe_recompute=sum(c.act_moe_recompute for c in mine),
                act_input=sum(c.act_input for c in mine),
                act_block_max=max(c.act_block_max for c in mine),
                head_act=sum(c.head_act for c in mine),
            )
        )
    return tuple(out)
