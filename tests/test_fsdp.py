"""parallelize() on FSDP2: ddp and fsdp at (dp, ep) in (4,1), (2,2), (1,4) on 4 gloo ranks
equal single-process training on the global batch; fsdp holds 1/world of every tensor."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import moe
from moe.parallel import init_mesh, parallelize
from tests.distributed import run_ranks
from tests.test_parallel import D, build_model

LAYOUTS = [(4, 1), (2, 2), (1, 4)]
SIZES = [5, 7, 3, 6]  # uneven rows per rank
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _batch(step):
    g = torch.Generator().manual_seed(10 + step)
    n = sum(SIZES)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def _loss(model, x, y, world, n_global):
    """Per-rank loss whose gradient, averaged over ranks, is the global mean's gradient."""
    out = model(x)
    return out, (out - y).square().sum() * world / (n_global * D)


def _run(model, shard, world, opt_steps):
    """Outputs and gradients of step 0, then the outputs after one SGD step and after two
    AdamW steps (on fresh batches)."""
    x, y = (t[shard] for t in _batch(0))
    out, loss = _loss(model, x, y, world, sum(SIZES))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    record = {"out0": out.detach().clone(), "grads": grads}
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd.step()
    sgd.zero_grad()
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2):
        x, y = (t[shard] for t in _batch(step))
        out, loss = _loss(model, x, y, world, sum(SIZES))
        record[f"out{step}"] = out.detach().clone()
        loss.backward()
        adam.step()
        adam.zero_grad()
    record["adam"] = adam
    return record


def _local_fraction(t):
    return t.to_local().numel() / t.numel()


def _layouts_body(rank, world):
    start = sum(SIZES[:rank])
    shard = slice(start, start + SIZES[rank])
    reference = _run(build_model(), slice(None), 1, 2)
    report = []
    for mode in ("fsdp", "ddp"):
        for dp, ep in LAYOUTS:
            tag = f"{mode} dp={dp} ep={ep} rank {rank}"
            model = parallelize(build_model(), init_mesh(dp=dp, ep=ep), mode)
            names = dict(model.named_parameters())
            assert names.keys() == dict(build_model().named_parameters()).keys(), tag
            ref_params = dict(build_model().named_parameters())
            for n, p in names.items():
                assert isinstance(p, DTensor), f"{tag}: {n} is not a DTensor"
                assert p.shape == ref_params[n].shape, f"{tag}: {n} {p.shape}"
            got = _run(model, shard, world, 2)
            torch.testing.assert_close(got["out0"], reference["out0"][shard], **TOL, msg=tag)
            for n, g in got["grads"].items():
                want = reference["grads"][n]
                torch.testing.assert_close(g.full_tensor(), want, **TOL, msg=f"{tag} grad {n}")
            for step in (1, 2):
                want = reference[f"out{step}"][shard]
                torch.testing.assert_close(got[f"out{step}"], want, **TOL, msg=f"{tag} {step}")
            fractions = [_local_fraction(p) for p in names.values()]
            states = got["adam"].state.values()
            fractions += [_local_fraction(s["exp_avg"]) for s in states]
            if mode == "fsdp":  # every parameter and moment: 1/world on each rank
                assert all(f == 1 / world for f in fractions), (tag, fractions)
            else:  # ddp: dense whole, experts 1/ep
                experts = {n for n, _ in moe.parallel.expert_parameters(model)}
                want = [1 / ep if n in experts else 1.0 for n in names]
                assert fractions[: len(names)] == want, (tag, fractions)
            report.append(tag)
            dist.barrier()
    return report


def test_ddp_and_fsdp_equal_single_process_at_every_layout():
    reports = run_ranks(_layouts_body, 4, timeout=300)
    assert all(len(r) == 2 * len(LAYOUTS) for r in reports)
