"""LoRA on the experts under moe.parallel.parallelize (issue 50, item 2): on 2 and 4 gloo ranks
(ep = 2, dp = 1 and 2) under ddp and fsdp (and the overlapped dispatcher on 2), the outputs, input
gradients and adapter gradients equal one process's on the same global batch; adapters are
Shard(0) DTensors over "ep" like the weights; only adapters get gradients and optimizer state;
an adapters-only DCP checkpoint (save_checkpoint(trainable_only=True)) is small and loads at
another (dp, ep) exactly."""

import os
import pathlib
import tempfile

import torch
from torch.distributed.tensor import DTensor, Shard

import moe
from moe.checkpoint import load_checkpoint, save_checkpoint
from moe.lora import LoRAConfig, adapter_parameters, adapter_state_dict, add_lora, merge
from moe.lora import kernel as lora_kernel
from moe.parallel import init_mesh, parallelize
from tests.distributed import run_ranks

D, F, E = 6, 10, 4
CFG = LoRAConfig(rank=3, alpha=6.0, dropout=0.2, shared_experts=True, router=True)


def _sign_dropout(x, p):
    return x * (x > 0) / (1 - p) if p > 0 else x


def _model(seed=0):
    torch.manual_seed(seed)
    layer = moe.MoELayer(
        D, F, E, top_k=2, activation="swiglu", dtype=torch.float64, num_shared_experts=1
    )
    layer.router.double()
    add_lora(layer, CFG)
    with torch.no_grad():
        for n, p in adapter_parameters(layer):
            if "lora_B" in n:
                p.copy_(torch.randn_like(p))
    return layer


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(model, x, scale=1.0) -> dict:
    y = model(x)
    (y.square().sum() * scale).backward()
    out = {"y": y.detach(), "dx": x.grad}
    for name, p in model.named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name  # only adapters get gradients
        if p.grad is not None:
            out[name] = _full(p.grad)
    return out


def _body(rank, world, ckpt):
    lora_kernel.adapter_dropout = _sign_dropout  # a known mask, the same on every rank
    sizes = [3, 5, 4, 2][:world]
    x_all = torch.randn(
        sum(sizes), D, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    want = _grads(_model(), x_all.clone().requires_grad_(), 1.0 / world)
    want["y"], want["dx"] = want["y"][mine], want["dx"][mine] * world
    diffs = {}
    modes = [("ddp", {}), ("fsdp", {})] + ([("ddp", {"overlap": 2})] if world == 2 else [])
    for mode, extra in modes:
        model = parallelize(_model(), init_mesh(dp=world // 2, ep=2), mode, **extra)
        a = model.experts.lora_A_w2
        assert isinstance(a, DTensor) and a.placements[-1] == Shard(0), a.placements
        assert a.to_local().shape[0] <= E // 2
        got = _grads(model, x_all[mine].clone().requires_grad_())
        assert got.keys() == want.keys(), (got.keys(), want.keys())
        diffs[f"{mode} {extra}"] = {
            k: float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want
        }
    # an optimizer of the adapters: state for them alone; the frozen base does not move
    model = parallelize(_model(), init_mesh(dp=world // 2, ep=2), "fsdp")
    plain = parallelize(moe.MoELayer(D, F, E), init_mesh(dp=world // 2, ep=2), "ddp")
    try:
        add_lora(plain, CFG)
    except ValueError as e:
        assert "before moe.parallel.parallelize" in str(e)
    else:
        raise AssertionError("add_lora after parallelize was not refused")
    base = {n: _full(p).clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for _, p in adapter_parameters(model)], lr=1e-2)
    for _ in range(2):
        model(x_all[mine]).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(_full(p), base[n]) for n, p in model.named_parameters() if n in base)
    assert len(opt.state) == len(adapter_parameters(model)) == 6 + 6 + 2
    model.eval()  # merge on the shards: the same outputs without the adapters
    y = model(x_all[mine]).detach()
    merge(model)
    assert not adapter_state_dict(model) and model.config.lora is None
    diffs["merge"] = {"y": float((model(x_all[mine]) - y).abs().max() / y.abs().max())}
    model.train()
    if world == 2:
        model = parallelize(_model(), init_mesh(dp=1, ep=2), "fsdp")
        opt = torch.optim.AdamW([p for _, p in adapter_parameters(model)], lr=1e-2)
        model(x_all[mine]).square().sum().backward()
        opt.step()
        save_checkpoint(ckpt, model, opt, trainable_only=True)
        saved = {k: _full(v).clone() for k, v in adapter_state_dict(model).items()}
        moments = {n: _full(opt.state[p]["exp_avg"]) for n, p in adapter_parameters(model)}
        other = parallelize(_model(seed=5), init_mesh(dp=2, ep=1), "fsdp")  # another base
        try:
            load_checkpoint(ckpt, other)
        except ValueError as e:
            assert "trained on another base model" in str(e), e
        else:
            raise AssertionError("an adapters-only checkpoint loaded onto another base")
        fresh = parallelize(_model(seed=0), init_mesh(dp=2, ep=1), "fsdp")  # another layout
        fresh_opt = torch.optim.AdamW([p for _, p in adapter_parameters(fresh)], lr=1e-2)
        load_checkpoint(ckpt, fresh, fresh_opt)
        loaded = {k: _full(v) for k, v in adapter_state_dict(fresh).items()}
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        for n, p in adapter_parameters(fresh):
            assert torch.equal(_full(fresh_opt.state[p]["exp_avg"]), moments[n]), n
        y_a, y_b = model(x_all[mine]), fresh(x_all[mine])  # the base and the adapters
        torch.testing.assert_close(y_a, y_b, rtol=1e-12, atol=1e-12)
    return diffs


def _check(results):
    for diffs in results:
        for name, by_tensor in diffs.items():
            if name != "merge":
                keys = {"y", "dx", "experts.lora_A_w1", "shared_experts.up_proj.lora_B"}
                assert keys | {"router.lora_A"} <= set(by_tensor), by_tensor
            assert max(by_tensor.values()) < 1e-12, (name, by_tensor)


def test_lora_on_2_ranks_ep2_equals_one_process_and_adapters_only_checkpoint():
    with tempfile.TemporaryDirectory() as ckpt:
        _check(run_ranks(_body, 2, ckpt, timeout=300))
        files = [os.path.join(r, f) for r, _, fs in os.walk(ckpt) for f in fs]
        meta = next(pathlib.Path(f).read_text() for f in files if f.endswith("metadata.json"))
        assert '"model/experts.lora_A_w1"' in meta and '"model/experts.w1"' not in meta
        tensor_bytes = sum(os.path.getsize(f) for f in files if not f.endswith(".json"))
        adapters = sum(p.numel() * 8 for _, p in adapter_parameters(_model()))
        # the adapters, their two AdamW moments and step counts (metadata: no base weights)
        assert tensor_bytes < 3 * adapters + 4096, (tensor_bytes, adapters)


def test_lora_on_4_ranks_dp2_ep2_equals_one_process():
    with tempfile.TemporaryDirectory() as ckpt:
        _check(run_ranks(_body, 4, ckpt, timeout=400))
