"""One typed layout (issue 59, item 3): the planner's stage split is the one the pipeline
builds (its own function, on a real nn.Sequential), its rules are the pipeline's, and what it
returns are the typed values the library takes (ParallelConfig, PipelineConfig, MoEConfig
fields) from which its code is rendered."""

import itertools
import random

import pytest
import torch
from torch import nn

from moe.parallel import ParallelConfig
from moe.pipeline import SCHEDULES, PipelineConfig, plan_stages
from moe.pipeline.split import SPLITS
from moe.plan import Layout, SearchSpace, preset, search
from moe.plan.search import _ep_options, refusal
from moe.plan.spec import ModelSpec
from moe.plan.stages import block_split, rank_sums, stack_weights


class Box(nn.Module):
    """A child with n parameters (meta: nothing allocated)."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, device="meta"))


def _spec(blocks: int, rng: random.Random) -> ModelSpec:
    return ModelSpec(
        name="t", n_layers=blocks, d_model=8 * rng.randint(1, 8), n_heads=2,
        vocab_size=rng.choice((50, 1000, 30000)), num_experts=rng.choice((2, 8, 64)), top_k=2,
        d_ff_expert=8 * rng.randint(1, 16), d_ff_dense=8 * rng.randint(1, 64),
        first_dense=rng.randint(0, 2), moe_every=rng.randint(1, 2),
        tie_embeddings=rng.random() < 0.3,
    )  # fmt: skip


def _stack(spec: ModelSpec, spare: int = 0) -> nn.Sequential:
    """The (embedding, blocks, head) stack with the planner's parameter counts per child."""
    return nn.Sequential(*[Box(n) for n in stack_weights(spec, spare)])


def _pipeline_blocks(spec, pp, config, spare=0) -> list[int]:
    """Blocks per pp rank as the pipeline splits and places a stack of spec's children."""
    plan = plan_stages(_stack(spec, spare), pp * config.stages_per_rank, None, config.split)
    per_stage = [sum(0 < int(n) <= spec.n_layers for n in names) for names in plan]
    ranks = [0] * pp
    for stage, rank in enumerate(config.stage_ranks(pp)):
        ranks[rank] += per_stage[stage]
    return ranks


def _planner_blocks(spec, pp, config, spare=0) -> list[int]:
    layout = Layout(pp, 1, 1, "ddp", config.schedule, config.stages_per_rank,
                    config.microbatches, split=config.split, replicas=spare)  # fmt: skip
    sums = rank_sums(spec, 16, pp, layout.pipeline, None, spare)
    return [r.blocks for r in sums]


def test_issue_examples_split_as_the_pipeline_builds():
    rng = random.Random(0)
    for blocks, pp, want in ((4, 3, [1, 2, 1]), (6, 4, [1, 2, 2, 1])):
        spec = _spec(blocks, rng)
        config = PipelineConfig(microbatches=pp)
        assert _pipeline_blocks(spec, pp, config) == want
        assert [n for _, n, _, _ in block_split(spec, pp)] == want
        assert _planner_blocks(spec, pp, config) == want


def test_planner_split_equals_the_pipelines_over_many_combinations():
    """Every (blocks, pp, schedule, stages per rank, split) with a stack the pipeline can
    split: the planner's blocks per pp rank, embedding and head owners equal the pipeline's."""
    rng = random.Random(1)
    checked = 0
    for blocks, pp, name, split in itertools.product(range(1, 10), range(1, 6), SCHEDULES, SPLITS):
        style = PipelineConfig(name, stages_per_rank=2 if name in ("ZBVZeroBubble", "DualPipeV")
                               else 1).style  # fmt: skip
        for v in {"single": (1,), "v": (2,), "loop": (1, 2, 3)}[style]:
            if pp * v > blocks + 2:
                continue
            config = PipelineConfig(name, microbatches=4 * pp, stages_per_rank=v, split=split)
            spec = _spec(blocks, rng)
            spare = rng.choice((0, 2))
            assert _planner_blocks(spec, pp, config, spare) == _pipeline_blocks(
                spec, pp, config, spare
            ), (blocks, pp, name, v, split)
            plan = plan_stages(_stack(spec, spare), pp * v, None, split)
            ends = [(names[0] == "0", names[-1] == str(blocks + 1)) for names in plan]
            assert [(e, h) for _, _, e, h in block_split(spec, pp * v, split, spare)] == ends
            checked += 1
    assert checked > 300


def test_search_returns_only_layouts_the_pipeline_accepts():
    """On the typed layout (not the code string): every fitting and misfit layout passes the
    pipeline's own check, in spaces beyond the default (every schedule, v up to 3, both
    splits, spare slots); no fsdp with a split-backward schedule; the best one fits."""
    spec = ModelSpec(name="t", n_layers=6, d_model=256, n_heads=4, vocab_size=1000,
                     num_experts=8, top_k=2, d_ff_expert=512, d_ff_dense=1024)  # fmt: skip
    space = SearchSpace(
        schedules=tuple(SCHEDULES), virtual=(2, 3), splits=SPLITS, replicas=(0, 4),
        micro_batch_seqs=(1, 2),
    )  # fmt: skip
    result = search(spec, preset("h100", 1, gpus_per_node=4), 64 * 128, 128, space=space,
                    top=10**6, skew=1.2)  # fmt: skip
    layouts = [p.layout for p in result.fits] + [p.layout for p, _ in result.misfits]
    assert {lay.pp for lay in layouts} >= {1, 2, 4}
    assert {lay.split for lay in layouts if lay.pp > 1} == set(SPLITS)
    for lay in layouts:
        assert refusal(spec, lay) is None
        if lay.pp > 1:
            pipe = lay.pipeline
            assert isinstance(pipe, PipelineConfig) and pipe.schedule == lay.schedule
            pipe.check(lay.pp, lay.parallel.data_parallel, stack_weights(spec, lay.replicas))
            assert not (pipe.style != "single" and pipe.schedule in ("InterleavedZeroBubble",
                        "ZBVZeroBubble", "DualPipeV") and lay.data_parallel == "fsdp")  # fmt: skip
    assert result.best().fits
    assert all(p.fits for p in result.fits)


def test_layout_returns_the_typed_values_and_renders_code_from_them():
    lay = Layout(2, 2, 2, "ddp", "Interleaved1F1B", 2, 8, 2, recompute="moe", overlap=2,
                 fp8_dispatch=True, replicas=2, capacity_factor=1.25)  # fmt: skip
    assert lay.parallel == ParallelConfig("ddp", "flat", overlap=2)
    assert lay.pipeline == PipelineConfig("Interleaved1F1B", microbatches=8, stages_per_rank=2)
    settings = lay.moe_settings
    assert settings["recompute"] is True and settings["spare_slots"] == 2
    assert settings["capacity_factor"] == 1.25
    assert settings["fp8"].dispatch and not settings["fp8"].experts
    names = {}
    code = lay.code()
    setup = [line for line in code.splitlines() if line.startswith(("import", "from", "moe_s"))]
    exec("\n".join(setup), names)  # the printed settings are these typed values
    assert names["moe_settings"] == settings
    config_line = next(line for line in code.splitlines() if line.startswith("config = "))
    exec(config_line, names)
    assert names["config"] == lay.pipeline
    assert Layout(1, 4, 1).pipeline is None


@pytest.mark.parametrize("pp", (1, 2))
def test_refusal_is_the_pipelines_error(pp):
    bad = Layout(pp, 1, 1, "fsdp", "ZBVZeroBubble" if pp > 1 else "none", 2 if pp > 1 else 1, 4)
    spec = ModelSpec(name="t", n_layers=4, d_model=8, n_heads=2, vocab_size=10, num_experts=2,
                     top_k=1, d_ff_expert=8, d_ff_dense=8)  # fmt: skip
    if pp == 1:
        assert refusal(spec, bad) is None
        return
    with pytest.raises(ValueError) as e:
        bad.pipeline.check_data_parallel("fsdp")
    assert refusal(spec, bad) == str(e.value)


def test_spare_slots_parallelize_refuses_are_never_returned():
    """parallelize's own rule (moe.slots.layout.check_spare_slots): a multiple of ep and at
    most E x (ep - 1) copies; with 2 experts at ep = 2, 4 spare slots are refused."""
    spec = ModelSpec(name="t", n_layers=2, d_model=64, n_heads=2, vocab_size=100,
                     num_experts=2, top_k=1, d_ff_expert=64, d_ff_dense=64)  # fmt: skip
    space = SearchSpace(pp=(1,), replicas=(0, 2, 3, 4, 6), micro_batch_seqs=(1,))
    result = search(spec, preset("h100", 1, gpus_per_node=2), 8 * 16, 16, space=space,
                    top=10**6, skew=2.0)  # fmt: skip
    layouts = [p.layout for p in result.fits]
    assert {lay.replicas for lay in layouts if lay.ep == 2} <= {0, 2}
    tried = _ep_options(spec, space, Layout(1, 1, 2), preset("h100", 1, gpus_per_node=2))
    assert {r for *_, r in tried} == {0, 2}  # what the search tries at ep = 2
    assert refusal(spec, Layout(1, 1, 2, replicas=4)).endswith("(2 experts x 2 ranks)")
    assert all(refusal(spec, lay) is None for lay in layouts)
