"""search(): every layout of a model on a cluster that the library can run, predicted and
ranked by step time; the ones that do not fit say why.

Searched: pp (and, for the interleaved schedules, SearchSpace.virtual stages per rank; the
V ones 2), every schedule and split, ep dividing the experts, dp the rest, ddp / fsdp,
sequences per micro-batch, capacity factors, FP8 dispatch / experts (when asked: they change
numerics), spare expert slots, and per layout the fastest memory savers that fit, of every
offload level: recompute (none, MoE-only, the fewest whole blocks, full; Whale's automatic
gradient checkpointing), offload (none, optimizer, all) and grouped apply groups; flat or
hierarchical exchange (when the EP group spans nodes) and the overlap degree are picked by
predicted time. Pruned before any prediction: every layout the pipeline refuses (its own
check, PipelineConfig.check, on the layout's typed values: micro-batch minimums, the
zero-bubble + fsdp refusal, fewer children than stages), ep not dividing the experts,
batches that do not split into the layout's pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from moe.pipeline.config import schedule_style
from moe.plan import fp8
from moe.plan.cluster import Cluster
from moe.plan.layout import Layout
from moe.plan.predict import MEMORY_TERMS, Prediction, predict
from moe.plan.skew import check_load, zipf_load
from moe.plan.spec import ModelSpec
from moe.plan.stages import rank_sums, stack_weights
from moe.slots.layout import check_spare_slots, initial_expert_of_slot

GiB = 2**30


@dataclass(frozen=True)
class SearchSpace:
    """What search() tries (each a tuple of choices)."""

    pp: tuple[int, ...] | None = None  # None: every divisor of the world up to the blocks
    schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV",
                                  "GPipe", "InterleavedZeroBubble")  # fmt: skip
    data_parallel: tuple[str, ...] = ("ddp", "fsdp")
    micro_batch_seqs: tuple[int, ...] = (1, 2, 4, 8)
    capacity_factors: tuple[float | None, ...] = (None,)
    overlap: tuple[int, ...] = (1, 2, 4)
    fp8: bool = False  # also FP8 dispatch and FP8 experts
    replicas: tuple[int, ...] = (0,)  # spare slots per MoE layer (those parallelize takes)
    groups: tuple[int, ...] = (1, 4, 16)
    recompute: tuple[str, ...] = ("none", "moe", "blocks", "full")
    offload: tuple[str | None, ...] = (None, "optimizer", "all")
    virtual: tuple[int, ...] = (2,)  # stages per rank of the interleaved schedules
    splits: tuple[str, ...] = ("children",)  # PipelineConfig.split (moe.pipeline.split.SPLITS)


@dataclass
class SearchResult:
    fits: list[Prediction]  # fastest first
    misfits: list[tuple[Prediction, str]]  # the closest ones that do not fit, and why
    searched: int  # predictions made

    def best(self) -> Prediction:
        return self.fits[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(space: SearchSpace, pp: int) -> list[tuple[str, int, str]]:
    """(schedule, stages per rank, split) to try at pp ranks: each schedule with the stage
    counts it runs (one per rank, two for the V ones, SearchSpace.virtual for the
    interleaved ones: PipelineConfig.style)."""
    if pp == 1:
        return [("none", 1, "children")]
    out = []
    for name in space.schedules:
        style = schedule_style(name)
        counts = space.virtual if style == "loop" else (2 if style == "v" else 1,)
        out += [(name, v, split) for v in counts for split in space.splits]
    return out


def refusal(spec: ModelSpec, layout: Layout) -> str | None:
    """Why moe.pipeline or parallelize would refuse `layout` for `spec`'s stack (embedding,
    blocks, head), by their own checks of the layout's typed values (PipelineConfig.check,
    moe.slots.layout.check_spare_slots on a layer's first placement); None: it runs."""
    try:
        pipeline, parallel = layout.pipeline, layout.parallel
        if pipeline is not None:
            children = stack_weights(spec, layout.replicas)
            pipeline.check(layout.pp, parallel.data_parallel, children)
        if layout.replicas:
            layer = SimpleNamespace(num_experts=spec.num_experts, spare_slots=layout.replicas)
            slots = initial_expert_of_slot(spec.num_experts, layout.replicas)
            check_spare_slots("every MoE layer", slots, layer, layout.ep)
    except ValueError as e:
        return str(e)
    return None


def _binding(pred: Prediction) -> str:
    """The largest memory category and the shortfall."""
    top = max(MEMORY_TERMS, key=lambda k: pred.memory[k])
    need, have = pred.peak_memory / GiB, pred.device_memory / GiB
    return (
        f"needs {need:.1f} GiB of {have:.1f} GiB (largest: {top} {pred.memory[top] / GiB:.1f} GiB)"
    )


def check_inputs(spec: ModelSpec, cluster: Cluster, seq_len: int, global_batch_tokens: int):
    for name, v in (("seq_len", seq_len), ("global_batch_tokens", global_batch_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if global_batch_tokens % seq_len:
        raise ValueError(
            f"global_batch_tokens={global_batch_tokens} is not a whole number of sequences of "
            f"seq_len={seq_len}"
        )
    seqs = global_batch_tokens // seq_len
    if seqs < cluster.world:
        raise ValueError(
            f"global_batch_tokens={global_batch_tokens} is {seqs} sequences of {seq_len}, fewer "
            f"than the {cluster.world} devices: every data-parallel rank needs one at least"
        )


def _memory_variants(space: SearchSpace, blocks: int) -> list[tuple[str, str | None]]:
    """(recompute, offload) pairs in order of expected cost (cheapest first)."""
    recompute = []
    for r in space.recompute:
        if r == "blocks":
            recompute += [f"blocks:{n}" for n in range(1, blocks)]
        else:
            recompute.append(r)
    return [(r, o) for o in space.offload for r in recompute]


def search(
    spec: ModelSpec,
    cluster: Cluster,
    global_batch_tokens: int,
    seq_len: int,
    *,
    space: SearchSpace | None = None,
    load=None,
    skew: float | None = None,
    top: int = 10,
) -> SearchResult:
    """Ranked layouts of `spec` on `cluster` for `global_batch_tokens` tokens a step in
    sequences of `seq_len`; `load` (per-expert token counts, e.g. a RoutingTrace's) or
    `skew` (Zipf) sets the routing imbalance (uniform if neither). Raises ValueError when
    no layout fits, naming the closest one and what binds it."""
    space = space or SearchSpace()
    check_inputs(spec, cluster, seq_len, global_batch_tokens)
    if load is not None and skew is not None:
        raise ValueError("give load or skew, not both")
    if load is not None:
        load = check_load(load, spec.num_experts)
    elif skew is not None:
        load = zipf_load(spec.num_experts, skew)
    world, seqs = cluster.world, global_batch_tokens // seq_len
    fits, misfits, searched = [], [], 0
    children = spec.n_layers + 2  # the stack the pipeline splits: embedding, blocks, head
    pps = space.pp or [p for p in _divisors(world) if p <= children]
    for pp in pps:
        if world % pp or pp > children:
            raise ValueError(
                f"pp={pp} does not divide the world {world} or exceeds the stack's {children} "
                "children (embedding, blocks, head)"
            )
        for ep in _divisors(world // pp):
            if spec.num_experts % ep:
                continue
            dp = world // (pp * ep)
            if seqs % (dp * ep):
                continue
            per_pipe = seqs // (dp * ep)
            for mbs in space.micro_batch_seqs:
                if per_pipe % mbs:
                    continue
                m = per_pipe // mbs
                for schedule, v, split in _schedules(space, pp):
                    for dpm in space.data_parallel:
                        base = Layout(pp, dp, ep, dpm, schedule, v, m, mbs, split=split)
                        if refusal(spec, base) is not None:
                            continue
                        got, n = _best_variant(spec, cluster, base, space, seq_len,
                                               global_batch_tokens, load)  # fmt: skip
                        searched += n
                        (fits if got.fits else misfits).append(got)
    fits.sort(key=lambda p: p.step_time)
    misfits.sort(key=lambda p: p.peak_memory / p.device_memory)
    if not fits:
        if not misfits:
            raise ValueError(
                f"no layout of {spec.name} on {world} devices splits {seqs} sequences: "
                f"choose a global batch divisible by the data-parallel ranks"
            )
        near = misfits[0]
        raise ValueError(
            f"{spec.name} fits no layout on {cluster.nodes} x {cluster.gpus_per_node} devices "
            f"of {cluster.device_memory_gib:g} GiB: the closest, {near.layout.short()}, "
            f"{_binding(near)} even with full recompute and offload"
        )
    return SearchResult(fits[:top], [(p, _binding(p)) for p in misfits[:top]], searched)


def _best_variant(spec, cluster, base, space, seq_len, tokens, load) -> tuple[Prediction, int]:
    """The fastest fitting variant of `base`, or the one closest to fitting; and how many
    predictions it took. Per FP8 choice (bf16 only unless asked; moe/plan/fp8.py), of every
    offload level, the fastest recompute that fits (the fewest whole blocks of a binary
    search, time growing with them) with the fewest groups that fit (groups cost no predicted
    time) are compared, so more memory never gives a slower layout; the exchange, overlap and
    spare slots are then tried on the fastest. Asked for FP8, the pick's notes say why it is
    FP8 or bf16 against the best of the other kind with the same exchange options."""
    count = 0

    def run(**changes) -> Prediction:
        nonlocal count
        count += 1
        return predict(spec, cluster, replace(base, **changes), seq_len, tokens, load)

    blocks = max(r.blocks for r in rank_sums(spec, seq_len, base.pp, base.pipeline, None))
    kinds = {}  # (fp8 dispatch, fp8 experts) -> the fastest fitting memory variant
    closest = None
    for fd, fe in fp8.choices(space.fp8, base.ep):
        got, near = _best_memory(run, space, blocks, {"fp8_dispatch": fd, "fp8_experts": fe})
        if closest is None or near.peak_memory < closest.peak_memory:
            closest = near
        if got is not None:
            kinds[fd, fe] = got
    if not kinds:
        return closest, count
    best = min(kinds.values(), key=lambda p: p.step_time)
    options = None
    for o, x, r in _ep_options(spec, space, base, cluster):
        got = run(**{**_memory_of(best.layout), "overlap": o, "exchange": x, "replicas": r})
        if got.fits and got.step_time < best.step_time:
            best, options = got, {"overlap": o, "exchange": x, "replicas": r}
    if space.fp8:
        chosen_fp8 = best.layout.fp8_dispatch or best.layout.fp8_experts
        others = [p for k, p in kinds.items() if any(k) != chosen_fp8]
        other = min(others, key=lambda p: p.step_time) if others else None
        if other is not None and options:  # the same exchange options as the pick
            other = run(**{**_memory_of(other.layout), **options})
        best.notes.append(fp8.reason(best, other if other is None or other.fits else None))
    return best, count


def _best_memory(run, space, blocks: int, fixed: dict) -> tuple[Prediction | None, Prediction]:
    """(the fastest fitting memory variant or None, the one closest to fitting) with the
    layout fields `fixed`."""
    least = max(space.groups)
    best = closest = None
    for cf in space.capacity_factors:
        for offload in space.offload:
            fitting = []
            for recompute in space.recompute:
                if recompute == "blocks":
                    lo, hi = 1, blocks - 1  # the fewest recomputed blocks that fit
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if run(recompute=f"blocks:{mid}", offload=offload, groups=least,
                               capacity_factor=cf, **fixed).fits:  # fmt: skip
                            hi = mid
                        else:
                            lo = mid + 1
                    if lo < 1 or blocks < 2:
                        continue
                    recompute = f"blocks:{lo}"
                pred = run(recompute=recompute, offload=offload, groups=least, capacity_factor=cf,
                           **fixed)  # fmt: skip
                if closest is None or pred.peak_memory < closest.peak_memory:
                    closest = pred
                if pred.fits:
                    fitting.append(pred)
            if fitting:
                pick = min(fitting, key=lambda p: p.step_time).layout
                for groups in sorted(space.groups):
                    got = run(recompute=pick.recompute, offload=offload, groups=groups,
                              capacity_factor=cf, **fixed)  # fmt: skip
                    if got.fits:
                        break
                if best is None or got.step_time < best.step_time:
                    best = got
    return best, closest


def _memory_of(layout: Layout) -> dict:
    keys = ("recompute", "offload", "groups", "capacity_factor", "fp8_dispatch", "fp8_experts")
    return {k: getattr(layout, k) for k in keys}


def _ep_options(spec: ModelSpec, space: SearchSpace, base: Layout, cluster: Cluster) -> list:
    """(overlap, exchange, spare slots) to try."""
    if base.ep == 1:
        return [(1, "flat", 0)]
    exchanges = ("flat", "hierarchical") if base.ep > cluster.gpus_per_node else ("flat",)
    reps = [r for r in space.replicas if refusal(spec, replace(base, replicas=r)) is None]
    return [(o, x, r) for o in space.overlap for x in exchanges for r in reps]
