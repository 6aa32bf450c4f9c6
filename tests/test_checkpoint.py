"""Checkpoints on torch.distributed.checkpoint: single-process round trips with bit-exact
continuation (SGD, AdamW, GroupedApply), and resharding across layouts with torch's real
fully_shard + an "ep"-sharded DTensor expert weight (2 ranks -> 1 process -> 4 ranks)."""

import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe
from moe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moe.memory import GroupedApply
from tests.distributed import run_ranks
from tests.test_planner import TinyConfig, loss_of

CFG = TinyConfig(
    n_layers=2, d_model=16, n_heads=2, d_ff=24, vocab_size=20, seq_len=8, num_experts=4, moe_every=1
)
OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "grouped": lambda m: GroupedApply(m.named_parameters(), torch.optim.AdamW, 2, lr=1e-2),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return CFG.build()


def train(model: nn.Module, opt, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        tokens_BS = torch.randint(0, CFG.vocab_size, (3, CFG.seq_len), generator=gen)
        opt.zero_grad()
        loss_of(model, tokens_BS).backward()
        opt.step()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_bit_exact_continuation(tmp_path, kind):
    """Train 2 steps, save, load into a fresh model + optimizer, train 2 more: equal to 4
    uninterrupted steps, bit for bit."""
    model = make_model()
    opt = OPTIMIZERS[kind](model)
    train(model, opt, range(2))
    save_checkpoint(str(tmp_path), model, opt, extra={"step": 2, "note": "x"})
    twin = make_model(seed=9)
    twin_opt = OPTIMIZERS[kind](twin)
    for g in twin_opt.param_groups:
        g["lr"] = 123.0  # hyperparameters come from the checkpoint
    assert load_checkpoint(str(tmp_path), twin, twin_opt) == {"step": 2, "note": "x"}
    assert all(g["lr"] != 123.0 for g in twin_opt.param_groups)
    train(model, opt, range(2, 4))
    train(twin, twin_opt, range(2, 4))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    for name, b in model.named_buffers():
        assert torch.equal(b, dict(twin.named_buffers())[name]), name


def test_grouped_apply_bf16_masters_round_trip(tmp_path):
    model = make_model().to(torch.bfloat16)
    opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 3, "all", lr=1e-2)
    train(model, opt, range(2))
    save_checkpoint(str(tmp_path), model, opt)
    twin = make_model(seed=5).to(torch.bfloat16)
    twin_opt = GroupedApply(twin.named_parameters(), torch.optim.AdamW, 2, lr=1e-2)
    load_checkpoint(str(tmp_path), twin, twin_opt)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        a, b = opt.state_of(p), twin_opt.state_of(q)
        assert a.keys() == b.keys() and "master" in a
        for key in a:
            assert torch.equal(a[key].cpu(), b[key].cpu()), key


def test_weights_only_load_and_json_extra(tmp_path):
    model = make_model()
    opt = OPTIMIZERS["adamw"](model)
    train(model, opt, range(1))
    with pytest.raises(ValueError, match="extra must be JSON"):
        save_checkpoint(str(tmp_path), model, opt, extra={"t": torch.zeros(1)})
    assert not os.listdir(tmp_path)  # refused before anything was written
    save_checkpoint(str(tmp_path), model)
    twin = make_model(seed=1)
    load_checkpoint(str(tmp_path), twin)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(str(tmp_path), twin, OPTIMIZERS["adamw"](twin))


def test_check_extra_refuses_the_callers_metadata_before_anything_changes(tmp_path):
    model = make_model()
    opt = OPTIMIZERS["adamw"](model)
    train(model, opt, range(1))
    with pytest.raises(ValueError, match="extra must be a dict"):
        save_checkpoint(str(tmp_path), model, opt, extra=[1, 2])
    assert not os.listdir(tmp_path)
    save_checkpoint(str(tmp_path), model, opt, extra={"step": 1, "history": [0.5]})
    twin = make_model(seed=1)
    twin_opt = OPTIMIZERS["adamw"](twin)
    before = [p.detach().clone() for p in twin.parameters()]

    def check(extra):
        if extra.get("step") != 2:
            raise ValueError(f"field 'step' must be 2, got {extra.get('step')!r}")

    with pytest.raises(CheckpointError, match="extra: field 'step' must be 2, got 1"):
        load_checkpoint(str(tmp_path), twin, twin_opt, check_extra=check)
    assert all(torch.equal(p, q) for p, q in zip(before, twin.parameters()))  # nothing changed
    assert not twin_opt.state
    seen = []
    extra = load_checkpoint(str(tmp_path), twin, twin_opt, check_extra=seen.append)
    assert extra == {"step": 1, "history": [0.5]} and seen == [extra]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_loading_never_unpickles(tmp_path, monkeypatch):
    model = make_model()
    opt = OPTIMIZERS["adamw"](model)
    train(model, opt, range(1))
    save_checkpoint(str(tmp_path), model, opt)

    def forbidden(*args, **kwargs):
        raise AssertionError("checkpoint loading must not unpickle")

    for mod, name in [(pickle, "loads"), (pickle, "load"), (torch, "load")]:
        monkeypatch.setattr(mod, name, forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    twin = make_model(seed=2)
    load_checkpoint(str(tmp_path), twin, OPTIMIZERS["adamw"](twin))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(str(tmp_path / "nowhere"), twin)


# ---- multi-rank: torch's fully_shard on dense layers, an "ep"-sharded DTensor expert weight


class Tiny(nn.Module):
    """Dense layers of awkward sizes (FSDP shards unevenly) and a [E, D, F] expert weight."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3, bias=False))
        self.experts_w = nn.Parameter(torch.randn(4, 3, 5))
        self.register_buffer("bias_E", torch.randn(4))


def tiny(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Tiny()


def shard_tiny(model: Tiny, mesh) -> Tiny:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    fully_shard(model.dense, mesh=mesh)
    w = distribute_tensor(model.experts_w.detach(), mesh, [Shard(0)])
    model.experts_w = nn.Parameter(w)
    return model


def tiny_steps(model: nn.Module, opt, steps: range) -> None:
    """Deterministic full gradients, placed like each parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for step in steps:
        gen = torch.Generator().manual_seed(7 + step)
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            if isinstance(p, DTensor):
                g = distribute_tensor(g, p.device_mesh, p.placements)
            p.grad = g
        opt.step()


def full_state(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, gathered to full (global) tensors."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    out = {f"model/{n}": full(t) for n, t in model.state_dict().items()}
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optim/{n}/{k}"] = full(v)
    return out


def adamw(model: nn.Module):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _save_2(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh

    model = shard_tiny(tiny(0), init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    opt = adamw(model)
    tiny_steps(model, opt, range(2))
    save_checkpoint(path, model, opt, extra={"step": 2})
    return full_state(model, opt)


def _load_4(rank, world, path, data_file):
    from torch.distributed.device_mesh import init_device_mesh

    model = shard_tiny(tiny(3), init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    opt = adamw(model)
    extra = load_checkpoint(path, model, opt)
    loaded = full_state(model, opt)
    tiny_steps(model, opt, range(2, 3))
    after = full_state(model, opt)
    dist.barrier()
    if rank == 0:  # flip one byte that only some ranks read: every rank must raise
        with open(data_file, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:
        load_checkpoint(path, model, opt)
        error = None
    except CheckpointError as e:
        error = str(e)
    return extra, loaded, after, error


def test_reshard_2_ranks_to_1_process_to_4_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_2, 2, path, timeout=60)[0]
    directory = moe.checkpoint.checkpoint_dir(path)
    files = sorted(f for f in os.listdir(directory) if f.startswith("data-"))
    assert files == ["data-00000.bin", "data-00001.bin"]  # each rank wrote its own shards
    sizes = [os.path.getsize(os.path.join(directory, f)) for f in files]
    assert all(0 < s < sum(sizes) for s in sizes)

    reference = tiny(0)  # the same training in one process
    ref_opt = adamw(reference)
    tiny_steps(reference, ref_opt, range(2))
    for key, value in full_state(reference, ref_opt).items():
        assert torch.equal(saved[key], value), key

    single = tiny(5)
    single_opt = adamw(single)
    assert load_checkpoint(path, single, single_opt) == {"step": 2}
    for key, value in full_state(single, single_opt).items():
        assert torch.equal(saved[key], value), key

    tiny_steps(reference, ref_opt, range(2, 3))
    results = run_ranks(_load_4, 4, path, os.path.join(directory, files[1]), timeout=60)
    for extra, loaded, after, error in results:
        assert extra == {"step": 2}
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
        for key, value in full_state(reference, ref_opt).items():
            assert torch.equal(after[key], value), key
        assert error is not None and "checksum" in error, error


def _save_while_locked(rank, world, path):
    model = shard_tiny(tiny(0), _dp_mesh(world))
    try:
        save_checkpoint(path, model, adamw(model))
    except CheckpointError as e:
        return str(e)
    return None


def _dp_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def test_locked_folder_is_the_same_error_on_every_rank(tmp_path):
    """Rank 0 finds the folder locked by another saver: every rank raises, none hangs, and
    nothing is written."""
    from moe.checkpoint.folder import FolderLock

    lock = FolderLock(str(tmp_path))
    lock.acquire()
    try:
        errors = run_ranks(_save_while_locked, 2, str(tmp_path), timeout=60)
        assert os.listdir(tmp_path) == [".moe-save.lock"]
    finally:
        lock.release()
    assert all(e is not None and "another save into" in e for e in errors), errors
