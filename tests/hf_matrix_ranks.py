"""The contract families' multi-rank checks (tests/test_hf_contract_ep.py and the support table
tools/hf_support.py run them): every family moe.from_hf converts, tiny and in float64, under
expert parallelism (EP = 2 on gloo, ddp; fsdp for some) and in pipeline stages (pp = 2 through
moe.pipeline.hf_stack, 1F1B, 2 micro-batches), each against one process on the same global
batch. One start of the ranks runs every family; the ranks return their tensors and the
parent measures (worst relative error over logits, losses and every gradient)."""

import functools

import torch
import torch.nn.functional as F

import moe
from tests.hf_matrix import SETTINGS
from tests.hf_tiny import relative_error, run, tiny_model

EP_TOL = 1e-6  # routers in float32: their rounding depends on the batch (GLM-4.5's gate: 6e-8)
PP_TOL = 1e-12  # the pipeline runs each micro-batch as one process does


# HY-V4's indexer and hyper-connections compute in float32 inside the float64 model: their
# rounding depends on the batch (1.7e-6 / 2.6e-6 between one process and two ranks)
FLOAT32_INSIDE = {"hy_v4": 1e-5, "hy_v4_vl": 1e-5}


# routers that sample in training (PhiMoE's sparsemixer: Gumbel noise per call), whose draws
# depend on how the batch is split: checked in eval mode (deterministic routing; every gradient)
SAMPLED = {"phimoe"}


def _run(family: str, model, ids):
    """One forward and backward (tests/hf_tiny.run), in eval mode for SAMPLED families."""
    if family not in SAMPLED:
        return run(model, ids)
    model.eval()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def dtype_tol(family: str, tol: float) -> tuple[torch.dtype, float]:
    """The family's dtype (float64 unless transformers does not run it so: tests/hf_matrix's
    SETTINGS) and the tolerance there (at least that family's own)."""
    dtype, own = SETTINGS.get(family, (torch.float64, 0.0))
    return dtype, max(tol, own, FLOAT32_INSIDE.get(family, 0.0))


FSDP = ("glm4_moe", "qwen3_vl_moe", "ernie4_5_vl_moe", "deepseek_v3")  # also under FSDP2


def _ids(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (rows, 7), generator=torch.Generator().manual_seed(seed))


@functools.cache
def _start(family: str) -> dict:
    model = tiny_model(family, dtype_tol(family, 0.0)[0])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model.state_dict()


def converted(family: str):
    """The family's tiny model (float64 where transformers runs it so) (routers, norms and biases off their init), converted
    by moe.from_hf; the same on every rank, input jitter off. Tied embeddings untied (the pipeline refuses
    them: the embedding and the head sit on different stages)."""
    model = tiny_model(family, dtype_tol(family, 0.0)[0])
    model.load_state_dict(_start(family))
    for m in model.modules():  # PhiMoE's input jitter: random per call, rank and batch
        if getattr(m, "input_jitter_noise", 0.0):
            m.input_jitter_noise = 0.0
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embed.weight:  # (a token classifier: no LM head)
        head.weight = torch.nn.Parameter(embed.weight.detach().clone())
        model.config.tie_word_embeddings = False
        model.config.get_text_config().tie_word_embeddings = False
    return moe.from_hf(model)


def _grads(named) -> dict:
    from moe.shards import local

    return {n: None if p.grad is None else local(p.grad).detach().clone() for n, p in named}


def _ep(rank, family, data_parallel):
    from moe.parallel import init_mesh, parallelize

    model = converted(family)
    parallelize(model, init_mesh(dp=1, ep=2), data_parallel, sync_params=False)
    got = _run(family, model, _ids(10 + rank))
    return got.logits.detach(), got.loss.detach(), _grads(model.named_parameters())


def _loss(logits, target, scale):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") * scale


def _pp(rank, family):
    from moe.parallel import ParallelConfig
    from moe.pipeline import Pipeline, PipelineConfig, hf_stack, init_pipeline_mesh

    if family in SAMPLED:  # the pipeline trains in training mode
        raise ValueError("not compared: its router samples in training mode (Gumbel noise per "
                         "call), differently for each split of the batch")  # fmt: skip
    stack = hf_stack(converted(family), text_only=True)
    pipe = Pipeline(
        stack,
        init_pipeline_mesh(2, 1, 1),
        PipelineConfig("1F1B", microbatches=2),
        functools.partial(_loss, scale=1 / 14),
        ParallelConfig("ddp", "flat"),
    )
    out, losses = pipe.step(_ids(20, 4), _ids(21, 4))
    named = pipe.named_parameters()
    grads = {n: p.grad.full_tensor().detach().clone() for n, p in named if p.grad is not None}
    return out, losses, grads


def _ep_reference(family):
    model = converted(family)
    want = _run(family, model, torch.cat([_ids(10), _ids(11)]))
    return want.logits.detach(), want.loss.detach(), _grads(model.named_parameters())


def _pp_reference(family):
    """One process on the pipeline's two micro-batches: logits, losses, gradients (the loss
    and the MoE layers' aux loss per micro-batch, as the pipeline's backward takes them)."""
    model = converted(family)
    model.train()
    outs, losses = [], []
    for xm, ym in zip(_ids(20, 4).tensor_split(2), _ids(21, 4).tensor_split(2)):
        logits = model(input_ids=xm).logits
        loss = _loss(logits, ym, 1 / 14)
        (loss + moe.aux_loss(model) / 2).backward()
        outs.append(logits.detach())
        losses.append(loss.detach())
    return torch.cat(outs), losses, _grads(model.named_parameters())


def body(rank, world, ep_cases, pp_families):
    """Every case on this rank: {("ep", family, data_parallel): ..., ("pp", family): ...}
    (hf_stack's refusal: its text), and the one-process references of every other family
    (the ranks share that work): {("ep_ref", family): ..., ("pp_ref", family): ...}."""
    out = {}
    for family, data_parallel in ep_cases:
        try:  # a family failing on both ranks alike is reported, the others still run
            out["ep", family, data_parallel] = _ep(rank, family, data_parallel)
        except Exception as e:  # noqa: BLE001
            out["ep", family, data_parallel] = f"failed: {type(e).__name__}: {e}"
    for family in pp_families:
        try:
            out["pp", family] = _pp(rank, family)
        except ValueError as e:
            out["pp", family] = str(e)
        except Exception as e:  # noqa: BLE001
            out["pp", family] = f"failed: {type(e).__name__}: {e}"
    for i, family in enumerate(dict.fromkeys(f for f, _ in ep_cases)):
        if i % world == rank and not isinstance(out["ep", family, "ddp"], str):
            out["ep_ref", family] = _ep_reference(family)
    for i, family in enumerate(pp_families):
        if i % world == rank and not isinstance(out["pp", family], str):
            out["pp_ref", family] = _pp_reference(family)
    return out


def _merged(ranks: list, key):
    return next(r[key] for r in ranks if key in r)


def ep_errors(family: str, data_parallel: str, ranks: list) -> dict | str:
    """Worst relative errors of EP = 2 against one process on both ranks' rows: logits,
    loss (the ranks' mean against the global batch's) and every gradient (a rank's shard
    against its slice, or 1e-4 of the largest gradient where that is larger); or what failed."""
    got = [r["ep", family, data_parallel] for r in ranks]
    if any(isinstance(g, str) for g in got):
        return next(g for g in got if isinstance(g, str))
    want_logits, want_loss, want_grads = _merged(ranks, ("ep_ref", family))
    losses = sum(float(g[1]) for g in got) / len(got)
    errors = {"logits": 0.0, "loss": abs(losses - float(want_loss)) / abs(float(want_loss))}
    # a near-zero gradient against 1e-4 of the largest one (as tests/hf_tiny.gradient_errors)
    floor = 1e-4 * max(float(g.norm()) for g in want_grads.values() if g is not None)
    for rank, (logits, _, grads) in enumerate(got):
        rows = want_logits[2 * rank : 2 * rank + 2]
        errors["logits"] = max(errors["logits"], relative_error(logits, rows))
        for name, g in want_grads.items():
            if g is None or grads[name] is None:  # unused on every rank alike, or a failure
                err = 0.0 if g is None and grads[name] is None else float("inf")
            else:
                if grads[name].shape != g.shape:  # this rank's shard: experts' half over ep,
                    g = g.chunk(2, 0)[rank]  # FSDP2's chunk of dim 0
                err = relative_error(grads[name], g, floor)
            errors[name] = max(errors.get(name, 0.0), err)
    return errors


def pp_errors(family: str, ranks: list) -> dict | str:
    """Worst relative errors of pp = 2 against one process (the converted model on the same
    two micro-batches): logits and losses (last stage), every gradient (both stages, named as
    the model's), or hf_stack's refusal."""
    if isinstance(ranks[0]["pp", family], str):
        return ranks[0]["pp", family]
    outs, losses, want = _merged(ranks, ("pp_ref", family))
    out, got_losses, _ = ranks[1]["pp", family]  # the last stage
    errors = {"logits": relative_error(out, outs)}
    errors["loss"] = max(relative_error(a, b) for a, b in zip(got_losses, losses))
    want = {n: g for n, g in want.items() if g is not None}
    seen = set()
    for r in ranks:
        for name, g in r["pp", family][2].items():
            errors[name] = relative_error(g, want[name], 1e-12)
            seen.add(name)
    for name in set(want) - seen:  # a trained parameter no stage holds
        errors[name] = float("inf")
    return errors
