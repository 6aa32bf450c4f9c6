"""Checkpoints: round trips across EP sizes 4 -> 2 -> 1 -> 4 on gloo ranks (experts by global
id, optimizer state resharded), atomic saves, and clear errors for damaged or mismatched
checkpoints. Sharding here is the parallelize() convention applied by hand (no exchange)."""

import copy
import json
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe
from moe.checkpoint import CheckpointError
from moe.checkpoint import native as ckpt
from moe.parallel import GroupedApply, load_checkpoint, save_checkpoint
from tests.distributed import run_ranks
from tests.test_planner import TinyConfig

ADAMW = dict(lr=1e-2, weight_decay=0.1)
CFG = TinyConfig(
    n_layers=2, d_model=16, n_heads=2, d_ff=24, vocab_size=20, seq_len=8, num_experts=4, moe_every=1
)


def shard_experts_(model: nn.Module, ep_rank: int, ep: int) -> nn.Module:
    """Keep experts [r*E/ep, (r+1)*E/ep) of every GroupedExperts (dim 0 of each parameter,
    gradients too) and set expert_offset / num_global_experts, as parallelize() does."""
    for m in model.modules():
        if not isinstance(m, moe.GroupedExperts):
            continue
        E = m.num_global_experts if m.num_experts != m.num_global_experts else m.num_experts
        n = E // ep
        lo = ep_rank * n
        for name, p in list(m.named_parameters(recurse=False)):
            new = nn.Parameter(p.detach()[lo : lo + n].clone(), requires_grad=p.requires_grad)
            if p.grad is not None:
                new.grad = p.grad[lo : lo + n].clone()
            setattr(m, name, new)
        m.expert_offset, m.num_global_experts = lo, E
    return model


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return CFG.build()


def step_grads(model: nn.Module, step: int) -> None:
    """Deterministic full-model gradients for `step`, sliced for sharded experts."""
    gen = torch.Generator().manual_seed(100 + step)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, moe.GroupedExperts)}
    for name, p in model.named_parameters():
        module = experts.get(name.rsplit(".", 1)[0])
        shape = p.shape
        if module is not None:
            shape = (module.num_global_experts, *p.shape[1:])
        g = torch.randn(shape, generator=gen)
        if module is not None:
            g = g[module.expert_offset : module.expert_offset + p.shape[0]]
        p.grad = g.to(p.dtype)


def full_tensors(model: nn.Module, opt, group) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, expert slices gathered over `group`."""
    experts = {n for n, _ in moe.parallel.expert_parameters(model)}
    out = {}
    for name, p in model.named_parameters():
        items = [("param", p.detach())]
        items += [(k, v) for k, v in opt.state_of(p).items() if isinstance(v, torch.Tensor)]
        for key, t in items:
            if name in experts and t.dim() > 0 and group is not None:
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, t.contiguous(), group=group)
                t = torch.cat(parts)
            out[f"{name}/{key}"] = t.clone()
    return out


def _round_trip_body(rank, world_size, path):
    ref = make_model(0)
    ref_opt = GroupedApply(ref.named_parameters(), torch.optim.AdamW, 2, **ADAMW)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator())
    results, expected = [], None
    phases = [(4, 3, None), (2, 2, "all"), (1, 1, None), (4, 4, "optimizer")]
    for phase, (ep, groups, offload) in enumerate(phases):
        mesh = moe.parallel.init_mesh(dp=world_size // ep, ep=ep)
        seed = 0 if phase == 0 else 10 + phase  # later phases start from other weights
        model = shard_experts_(make_model(seed), mesh.get_local_rank("ep"), ep)
        opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, groups, offload, **ADAMW)
        group = mesh.get_group("ep") if ep > 1 else None
        if phase:
            load_checkpoint(path, model, opt)
            got = full_tensors(model, opt, group)
            assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
            for key in expected:  # exactly what was saved at the previous ep size
                assert torch.equal(got[key], expected[key]), f"phase {phase} ep={ep}: {key}"
            for key, want in full_tensors(ref, ref_opt, None).items():  # same trajectory
                torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6, msg=key)
            results.append(f"loaded at ep={ep}")
        step_grads(model, phase)
        step_grads(ref, phase)
        opt.step()
        ref_opt.step()
        save_checkpoint(path, model, opt, extra={"phase": phase})
        expected = full_tensors(model, opt, group)
    # Reassemble the ep=4 model single-process: same outputs as the unsharded reference.
    whole = make_model(seed=99)
    with torch.no_grad():
        for name, p in whole.named_parameters():
            p.copy_(expected[f"{name}/param"])
    whole.eval()
    ref.eval()
    torch.testing.assert_close(whole(tokens), ref(tokens), rtol=1e-5, atol=1e-5)
    # A model with a different expert count fails on every rank, naming the tensor.
    bigger = TinyConfig(**{**CFG.__dict__, "num_experts": 8}).build()
    try:
        load_checkpoint(path, shard_experts_(bigger, mesh.get_local_rank("ep"), 4))
    except ValueError as e:
        results.append(str(e))
    return results


def test_round_trip_across_ep_sizes(tmp_path):
    results = run_ranks(_round_trip_body, 4, str(tmp_path / "ckpt"), timeout=90)
    for r in results:
        assert r[:3] == ["loaded at ep=2", "loaded at ep=1", "loaded at ep=4"]
        assert "experts.w1" in r[3] and "8 experts" in r[3]
    assert len(os.listdir(tmp_path / "ckpt")) == 2  # LATEST + one complete checkpoint


def trained(model: nn.Module, opt, steps: int = 2):
    for step in range(steps):
        step_grads(model, step)
        opt.step()
    return model, opt


def test_single_process_round_trip_bf16_masters(tmp_path):
    model = make_model().to(torch.bfloat16)
    opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 3, "all", **ADAMW)
    trained(model, opt)
    save_checkpoint(str(tmp_path), model, opt, extra={"step": 2})
    twin = make_model(seed=5).to(torch.bfloat16)
    twin_opt = GroupedApply(twin.named_parameters(), torch.optim.AdamW, 2, **ADAMW)
    assert load_checkpoint(str(tmp_path), twin, twin_opt) == {"step": 2}
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        a, b = opt.state_of(p), twin_opt.state_of(q)
        assert a.keys() == b.keys() and "master" in a
        for key in a:
            assert torch.equal(a[key].cpu(), b[key].cpu()), key


def test_plain_torch_optimizer_round_trip(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    trained(model, opt)
    save_checkpoint(str(tmp_path), model, opt)
    twin = make_model(seed=3)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.5)
    load_checkpoint(str(tmp_path), twin, twin_opt)
    assert twin_opt.param_groups[0]["lr"] == ADAMW["lr"]
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], twin_opt.state[q]["exp_avg_sq"])


def saved(tmp_path) -> tuple[str, dict]:
    model = make_model()
    opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 2, **ADAMW)
    trained(model, opt)
    save_checkpoint(str(tmp_path), model, opt)
    directory = ckpt.checkpoint_dir(str(tmp_path))
    return directory, json.load(open(os.path.join(directory, "manifest.json")))


def assert_untouched_after_error(tmp_path, match: str):
    model = make_model(seed=7)
    before = copy.deepcopy(model.state_dict())
    opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 2, **ADAMW)
    with pytest.raises(CheckpointError, match=match) as info:  # a ValueError
        load_checkpoint(str(tmp_path), model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified by a failed load"
    return str(info.value)


def test_truncated_file_names_the_tensor(tmp_path):
    directory, manifest = saved(tmp_path)
    data = os.path.join(directory, "data-00000.bin")
    last = max(manifest["tensors"].items(), key=lambda kv: kv[1]["offset"])[0]
    os.truncate(data, os.path.getsize(data) - 3)
    message = assert_untouched_after_error(tmp_path, "truncated")
    assert last in message


def test_corrupted_byte_names_the_tensor(tmp_path):
    directory, manifest = saved(tmp_path)
    key = "model/blocks.1.ffn.experts.w2#expert=3"
    entry = manifest["tensors"][key]
    with open(os.path.join(directory, entry["file"]), "r+b") as f:
        f.seek(entry["offset"] + 5)
        byte = f.read(1)
        f.seek(entry["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    message = assert_untouched_after_error(tmp_path, "checksum")
    assert key in message


def test_mismatched_model_names_the_tensor(tmp_path):
    saved(tmp_path)
    other = TinyConfig(**{**CFG.__dict__, "d_ff": 32}).build()
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.experts\.w1#expert=0.*shape"):
        load_checkpoint(str(tmp_path), other)


def test_killed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = make_model()
    opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 2, **ADAMW)
    trained(model, opt, 1)
    save_checkpoint(str(tmp_path), model, opt)
    good = copy.deepcopy(model.state_dict())
    trained(model, opt, 1)
    calls = {"n": 0}
    real = ckpt._write_tensor

    def dying(f, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("killed mid-save")
        real(f, data)

    monkeypatch.setattr(ckpt, "_write_tensor", dying)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), model, opt)
    monkeypatch.setattr(ckpt, "_write_tensor", real)
    assert any(n.startswith(".tmp-") for n in os.listdir(tmp_path))
    fresh = make_model(seed=4)
    load_checkpoint(str(tmp_path), fresh)
    assert all(torch.equal(v, good[k]) for k, v in fresh.state_dict().items())
    save_checkpoint(str(tmp_path), model, opt)  # the next save cleans up the leftovers
    assert sorted(n.split("-")[0] for n in os.listdir(tmp_path)) == ["LATEST", "ckpt"]


def test_loading_never_unpickles(tmp_path, monkeypatch):
    saved(tmp_path)

    def forbidden(*args, **kwargs):
        raise AssertionError("checkpoint loading must not unpickle")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    model = make_model(seed=2)
    load_checkpoint(str(tmp_path), model)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(str(tmp_path / "nowhere"), model)
