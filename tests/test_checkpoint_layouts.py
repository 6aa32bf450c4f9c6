"""A checkpoint saved by parallelize()'s FSDP2 layout at (dp=2, ep=2, fsdp) loads at
(dp=1, ep=4, ddp), at its own layout and in one process: weights and AdamW state come back bit
for bit, and training continues as it would have (bit-exactly at the same layout)."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe.checkpoint import load_checkpoint, save_checkpoint
from moe.parallel import init_mesh, parallelize
from tests.distributed import run_ranks
from tests.test_fsdp import SIZES, _batch, _loss
from tests.test_parallel import build_model

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model, opt) -> dict:
    out = {f"param {n}": _full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state[p].items():
            out[f"state {n} {key}"] = _full(value) if torch.is_tensor(value) else value
    return out


def _train(model, opt, steps, shard, world) -> None:
    for step in steps:
        x, y = (t[shard] for t in _batch(step))
        _, loss = _loss(model, x, y, world, sum(SIZES))
        loss.backward()
        opt.step()
        opt.zero_grad()


def _setup(layout, seed):
    model = build_model(seed=seed)
    if layout is not None:
        dp, ep, mode = layout
        model = parallelize(model, init_mesh(dp=dp, ep=ep), mode)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _shard(rank, world):
    if world == 1:
        return slice(None)
    start = sum(SIZES[:rank])
    return slice(start, start + SIZES[rank])


LOAD_LAYOUTS = {"dp=1 ep=4 ddp": (1, 4, "ddp"), "dp=2 ep=2 fsdp": (2, 2, "fsdp")}


def _save_body(rank, world, path):
    """Save at (dp=2, ep=2, fsdp) and train on; then, on the same 4 ranks (one start instead of
    three), load into fresh models at each of LOAD_LAYOUTS."""
    model, opt = _setup((2, 2, "fsdp"), seed=0)
    _train(model, opt, (0, 1), _shard(rank, world), world)
    save_checkpoint(path, model, opt, extra={"step": 2})
    saved = _snapshot(model, opt)
    _train(model, opt, (2, 3), _shard(rank, world), world)
    uninterrupted = _snapshot(model, opt)
    del model, opt
    dist.barrier()  # every rank has saved before any rank loads
    runs = {name: _load_body(rank, world, path, layout) for name, layout in LOAD_LAYOUTS.items()}
    return saved, uninterrupted, runs


def _load_body(rank, world, path, layout):
    model, opt = _setup(layout, seed=5)  # other weights until the load
    extra = load_checkpoint(path, model, opt)
    loaded = _snapshot(model, opt)
    _train(model, opt, (2, 3), _shard(rank, world), world)
    return extra, loaded, _snapshot(model, opt)


def test_fsdp_checkpoint_loads_at_other_layouts_and_in_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    saved, uninterrupted, runs = run_ranks(_save_body, 4, path, timeout=90)[0]
    runs["one process"] = _load_body(0, 1, path, None)
    for name, (extra, loaded, continued) in runs.items():
        assert extra == {"step": 2}, name
        assert loaded.keys() == saved.keys(), name
        for key, value in saved.items():  # bit for bit: weights and optimizer state
            assert torch.equal(torch.as_tensor(loaded[key]), torch.as_tensor(value)), (name, key)
        for key, value in uninterrupted.items():
            if name == "dp=2 ep=2 fsdp":  # the same layout continues bit-exactly
                assert torch.equal(torch.as_tensor(continued[key]), torch.as_tensor(value)), key
            else:  # another layout sums gradients in another order
                torch.testing.assert_close(
                    torch.as_tensor(continued[key]),
                    torch.as_tensor(value),
                    **TOL,
                    msg=f"{name} {key}",
                )
