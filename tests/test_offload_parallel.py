"""GroupedApply(offload="optimizer" | "all") on parallelized models: 4 gloo ranks at dp 2 x
ep 2, ddp and fsdp, float64: the parameters after three steps (with clipping) equal the run
without offload to 1e-12; the offloaded runs keep no optimizer state in "device" memory (on
CPU: no state tensor outside the host store), and a checkpoint round trip keeps the state."""

import warnings

import torch
import torch.distributed as dist

import bench.offload_memory
from tests.distributed import run_ranks
from tests.test_parallel import D, build_model

SIZES = [5, 7, 3, 6]  # uneven rows per rank
STEPS = 3
OFFLOADS = (None, "optimizer", "all")


def _batch(step):
    g = torch.Generator().manual_seed(20 + step)
    n = sum(SIZES)
    return torch.randn(n, D, generator=g, dtype=torch.float64), torch.randn(
        n, D, generator=g, dtype=torch.float64
    )


def _build(mode, offload, seed=0):
    from moe.memory import GroupedApply
    from moe.parallel import init_mesh, parallelize

    mesh = init_mesh(dp=2, ep=2)
    model = parallelize(build_model(seed).double(), mesh, mode)
    opt = GroupedApply(
        model.named_parameters(), torch.optim.AdamW, 2, offload, lr=1e-2, weight_decay=0.1
    )
    return mesh, model, opt


def _train(mode, offload, rank, world, steps=range(STEPS), built=None):
    from moe.parallel import clip_grad_norm_

    mesh, model, opt = built or _build(mode, offload)
    start = sum(SIZES[:rank])
    rows = slice(start, start + SIZES[rank])
    for step in steps:
        x, y = (t[rows] for t in _batch(step))
        loss = (model(x) - y).square().sum() * world / (sum(SIZES) * D)
        loss.backward()
        clip_grad_norm_(model, 0.5, mesh=mesh, optimizer=opt)
        opt.step()
        opt.zero_grad()
    return model, opt


def device_state_bytes(opt) -> int:
    return sum(bench.offload_memory.device_state_bytes(opt))


def _body(rank, world, folder):
    from moe.checkpoint import load_checkpoint, save_checkpoint

    out = {}
    for mode in ("ddp", "fsdp"):
        runs = {}
        for offload in OFFLOADS:
            model, opt = _train(mode, offload, rank, world)
            params = [p.full_tensor() for p in model.parameters()]
            out[mode, offload, "bytes"] = device_state_bytes(opt)
            runs[offload] = (model, opt, params)
        ref = runs[None][2]
        for offload in OFFLOADS[1:]:
            err = max((a - b).abs().max().item() for a, b in zip(runs[offload][2], ref))
            out[mode, offload, "err"] = err
        # offloaded state saves, and loads into a fresh (other seed) offloaded optimizer:
        # one more step on both gives the same parameters
        model, opt, _ = runs["all"]
        path = f"{folder}/{mode}"
        save_checkpoint(path, model, opt)
        built = _build(mode, "optimizer", seed=1)
        load_checkpoint(path, built[1], built[2])
        twin, _ = _train(mode, "optimizer", rank, world, [STEPS], built)
        model, _ = _train(mode, "all", rank, world, [STEPS], (built[0], model, opt))
        out[mode, "reload"] = max(
            (p.full_tensor() - q.full_tensor()).abs().max().item()
            for p, q in zip(model.parameters(), twin.parameters())
        )
        dist.barrier()
    return out


def test_offload_under_ep_x_dp_equals_no_offload(tmp_path):
    results = run_ranks(_body, 4, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        for mode in ("ddp", "fsdp"):
            for offload in OFFLOADS[1:]:
                assert out[mode, offload, "err"] <= 1e-12, (rank, mode, offload, out)
                assert out[mode, offload, "bytes"] == 0, (rank, mode, offload)
            assert out[mode, None, "bytes"] > 0
            assert out[mode, "reload"] <= 1e-12, (rank, mode, out[mode, "reload"])


def _rebalance_body(rank, world):
    """ep = 2 with rebalance_experts after each step (experts and their state move between
    ranks): offloaded runs equal the run without offload."""
    from moe.memory import GroupedApply
    from moe.parallel import init_mesh, parallelize, rebalance_experts

    out = {}
    for mode in ("ddp", "fsdp"):
        params, moved = {}, {}
        for offload in OFFLOADS:
            model = parallelize(build_model().double(), init_mesh(dp=1, ep=2), mode)
            opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 2, offload, lr=1e-2)
            moved[offload] = 0
            for step in range(4):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(16, D, generator=g, dtype=torch.float64)[rank * 8 : rank * 8 + 8]
                x = x * (1 + step)
                model(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
                with warnings.catch_warnings(record=True) as caught:  # torch's deprecations
                    warnings.simplefilter("always")
                    moved[offload] += rebalance_experts(model, opt, min_gain=0.0).moved_experts
                out.setdefault("warnings", []).extend(str(w.message) for w in caught)
            params[offload] = [p.full_tensor() for p in model.parameters()]
        for offload in OFFLOADS[1:]:
            err = max((a - b).abs().max().item() for a, b in zip(params[offload], params[None]))
            out[mode, offload] = (err, moved[offload])
    return out


def test_offload_with_rebalance_equals_no_offload():
    for out in run_ranks(_rebalance_body, 2, timeout=300):
        assert out.pop("warnings") == []
        for key, (err, moved) in out.items():
            assert moved > 0 and err <= 1e-12, (key, err, moved)


FORMS = ("mul_", "assign", "copy_")


def _change_through_data(model, form):
    """Between steps, a change autograd's version counter does not see (HF init, EMA): on
    every parameter, DTensor or not, through `.data`."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if form == "mul_":
                p.data.mul_(0.5)
            elif form == "assign":
                p.data = p.detach() * -0.5 + 0.25
            else:
                p.data.copy_(torch.full_like(p.detach(), 0.01 * (i + 1)))


def _data_body(rank, world):
    """ep = 2 (ddp and fsdp): with weights changed through `.data` after the first step, the
    offloaded runs equal the run without offload (issue 49, item 4)."""
    from moe.memory import GroupedApply
    from moe.parallel import init_mesh, parallelize

    out = {}
    for mode in ("ddp", "fsdp"):
        for form in FORMS:
            params = {}
            for offload in OFFLOADS:
                model = parallelize(build_model().double(), init_mesh(dp=1, ep=2), mode)
                opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 2, offload, lr=1e-2)
                for step in range(3):
                    if step == 1:
                        _change_through_data(model, form)
                    g = torch.Generator().manual_seed(step)
                    x = torch.randn(16, D, generator=g, dtype=torch.float64)[
                        rank * 8 : rank * 8 + 8
                    ]
                    model(x).square().sum().backward()
                    opt.step()
                    opt.zero_grad()
                params[offload] = [p.full_tensor() for p in model.parameters()]
            for offload in OFFLOADS[1:]:
                out[mode, form, offload] = max(
                    (a - b).abs().max().item() for a, b in zip(params[offload], params[None])
                )
    return out


def test_offload_keeps_weights_changed_through_data():
    for out in run_ranks(_data_body, 2, timeout=300):
        for key, err in out.items():
            assert err <= 1e-12, (key, err, out)
