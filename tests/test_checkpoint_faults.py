"""Checkpoint fault injection (issue 13 items 1-4): path traversal, memory bombs, optimizer
state of the wrong shape, malformed metadata, corruption, legacy format, killed saves. Every
failure is one CheckpointError (a ValueError) naming what is wrong, and changes nothing."""

import copy
import json
import os
import random
import signal
import subprocess
import sys
import zlib

import pytest
import torch
from torch import nn

from moe.checkpoint import CheckpointError, checkpoint_dir, load_checkpoint, save_checkpoint
from moe.parallel import GroupedApply

KEY = "model/2.weight"


def model_and_opt(seed: int = 0, grouped: bool = False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    if grouped:
        opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, 2, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).square().sum().backward()
    opt.step()
    return model, opt


def saved(tmp_path, grouped: bool = False) -> tuple[str, dict]:
    model, opt = model_and_opt(grouped=grouped)
    save_checkpoint(str(tmp_path), model, opt, extra={"step": 1})
    directory = checkpoint_dir(str(tmp_path))
    with open(os.path.join(directory, "metadata.json")) as f:
        return directory, json.load(f)


def write_metadata(directory: str, doc) -> None:
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))


def refused(tmp_path, match: str, grouped: bool = False) -> str:
    """Load must raise CheckpointError matching `match` and leave model and optimizer as they
    were."""
    model, opt = model_and_opt(seed=3, grouped=grouped)
    before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(str(tmp_path), model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified by a failed load"
    after = opt.state_dict()
    assert after["param_groups"] == opt_before["param_groups"]
    for i, s in opt_before["state"].items():
        for k, v in s.items():
            assert torch.equal(after["state"][i][k], v), f"optimizer {i}/{k} was modified"
    return str(info.value)


def chunk(doc: dict, key: str = KEY) -> dict:
    return doc["tensors"][key]["chunks"][0]


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/dev/zero", "sub/../../x.bin", ""])
def test_path_traversal_refused(tmp_path, name):
    directory, doc = saved(tmp_path)
    chunk(doc)["file"] = name
    write_metadata(directory, doc)
    message = refused(tmp_path, "not a plain name inside the checkpoint")
    assert KEY in message and repr(name) in message


def test_symlink_leading_out_refused(tmp_path):
    directory, doc = saved(tmp_path / "ckpt")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(os.urandom(4096))
    os.symlink(outside, os.path.join(directory, "evil.bin"))
    chunk(doc)["file"] = "evil.bin"
    write_metadata(directory, doc)
    message = refused(tmp_path / "ckpt", "outside")
    assert KEY in message and "evil.bin" in message


def test_memory_bomb_refused_before_allocating(tmp_path):
    directory, doc = saved(tmp_path)
    n = 8 << 30  # 64 GiB of float64, declared consistently
    doc["tensors"][KEY].update(dtype="float64", shape=[n])
    chunk(doc).update(offsets=[0], sizes=[n], length=8 * n)
    write_metadata(directory, doc)
    message = refused(tmp_path, "beyond the end")
    assert KEY in message
    chunk(doc)["length"] = 100  # a declared length that disagrees with dtype x shape
    write_metadata(directory, doc)
    refused(tmp_path, r"length 100 bytes, but torch.float64 x \[8589934592\]")


@pytest.mark.parametrize("grouped", [False, True])
def test_optimizer_state_of_wrong_shape_refused(tmp_path, grouped):
    directory, doc = saved(tmp_path, grouped=grouped)
    key = "optim/0.weight/exp_avg"
    c = chunk(doc, key)
    with open(os.path.join(directory, c["file"]), "rb") as f:
        f.seek(c["offset"])
        data = f.read(8)
    doc["tensors"][key]["shape"] = [2]
    c.update(offsets=[0], sizes=[2], length=8, crc32=zlib.crc32(data))
    write_metadata(directory, doc)
    message = refused(tmp_path, "expected float32", grouped=grouped)
    assert key in message and "[2]" in message


def test_corrupted_and_truncated_data_refused(tmp_path):
    directory, doc = saved(tmp_path)
    c = chunk(doc)
    data = os.path.join(directory, c["file"])
    with open(data, "r+b") as f:
        f.seek(c["offset"] + 5)
        byte = f.read(1)
        f.seek(c["offset"] + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    assert KEY in refused(tmp_path, "checksum")
    os.truncate(data, 3)
    assert "beyond the end" in refused(tmp_path, "refused")


def _mutations():
    def drop(*path):
        def f(doc):
            *head, last = path
            for k in head:
                doc = doc[k]
            del doc[last]

        return f

    def put(value, *path):
        def f(doc):
            *head, last = path
            for k in head:
                doc = doc[k]
            doc[last] = value

        return f

    c = ("tensors", KEY, "chunks", 0)
    return {
        "missing format": (drop("format"), "missing key 'format'"),
        "wrong version": (put(1, "version"), "version 1"),
        "version as string": (put("2", "version"), "expected int"),
        "tensors not a dict": (put([], "tensors"), "expected dict"),
        "missing objects": (drop("objects"), "missing key 'objects'"),
        "unknown dtype": (put("float128", "tensors", KEY, "dtype"), "unsupported dtype"),
        "negative shape": (put([-3, 7], "tensors", KEY, "shape"), "integers >= 0"),
        "chunks not a list": (put({}, "tensors", KEY, "chunks"), "expected list"),
        "chunk not an object": (put(7, *c), "expected a JSON object"),
        "negative offset": (put(-8, *c, "offset"), "negative offset"),
        "bool length": (put(True, *c, "length"), "expected int"),
        "missing crc": (drop(*c, "crc32"), "missing key 'crc32'"),
        "chunk rank": (put([0], *c, "offsets"), "rank differs"),
        "chunk outside": (put([1, 0], *c, "offsets"), "exceeds shape"),
        "no chunks": (put([], "tensors", KEY, "chunks"), "cover 0 of 21"),
        "bad optimizer": (put("x", "objects", "optimizer"), "objects.optimizer"),
        "bad extra": (put([1], "objects", "extra"), "objects.extra"),
        "not an object": (lambda d: d.clear() or d.update(x=1), "missing key 'format'"),
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_malformed_metadata_is_one_clear_error(tmp_path, case):
    directory, doc = saved(tmp_path)
    mutate, match = _mutations()[case]
    mutate(doc)
    write_metadata(directory, doc)
    refused(tmp_path, match)


def test_overlapping_chunks_and_unparseable_metadata(tmp_path):
    directory, doc = saved(tmp_path)
    doc["tensors"][KEY]["chunks"].append(dict(chunk(doc)))
    write_metadata(directory, doc)
    refused(tmp_path, "overlap")
    write_metadata(directory, '{"format": "moe-dcp", "version": 2, "tensors": {')
    refused(tmp_path, "metadata.json.: not valid JSON")
    write_metadata(directory, [1, 2])
    refused(tmp_path, "expected a JSON object")


def test_latest_pointer_and_legacy_format(tmp_path):
    saved(tmp_path)
    (tmp_path / "LATEST").write_text("../../etc")
    refused(tmp_path, "not a checkpoint directory")
    legacy = tmp_path / "ckpt-0"
    legacy.mkdir()
    (legacy / "manifest.json").write_text(json.dumps({"format": "moe-checkpoint", "version": 1}))
    (tmp_path / "LATEST").write_text("ckpt-0")
    refused(tmp_path, "old moe-checkpoint v1")


SAVER = """
import sys, torch
from torch import nn
from moe.checkpoint import save_checkpoint
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(1, 10_000):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(step + i)
    save_checkpoint(sys.argv[1], model, opt, extra={"step": step})
    print(step, flush=True)
"""


def test_killed_saves_leave_the_previous_checkpoint_loadable(tmp_path):
    """SIGKILL a process that saves in a loop at random moments; the checkpoint it leaves
    always loads and holds the weights of one complete save."""
    rng = random.Random(1234)
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for trial in range(3):
        path = tmp_path / f"t{trial}"
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, env=env, text=True
        )
        try:
            for _ in range(rng.randint(1, 3)):  # wait for some complete saves
                assert proc.stdout.readline().strip(), "saver died"
            # kill somewhere inside a later save (random timing is the fault, not a sync)
            _kill_after(proc, rng.uniform(0.0, 0.05))
        finally:
            proc.kill()
            proc.wait(timeout=30)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = load_checkpoint(str(path), model, opt)["step"]
        for i, p in enumerate(model.parameters()):
            assert torch.equal(p, torch.full_like(p, step + i)), (trial, step)


def _kill_after(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)


def test_plain_local_expert_shards_refused(tmp_path):
    """Expert slices that are not DTensors cannot be saved as global tensors: a clear error
    before anything is written (parallelize gives DTensors)."""
    import moe

    model = nn.Sequential(moe.GroupedExperts(2, 4, 6, num_global_experts=4, expert_offset=2))
    with pytest.raises(CheckpointError, match="holds 2 of 4 experts as plain tensors"):
        save_checkpoint(str(tmp_path), model)
    assert not os.listdir(tmp_path)


def test_mismatched_model_names_the_tensors(tmp_path):
    saved(tmp_path)
    other = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, 1))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(tmp_path), other, torch.optim.SGD(other.parameters(), lr=0.1))
    message = str(info.value)
    assert "model/0.weight: checkpoint has float32[7, 5], expected float32[8, 5]" in message
    assert "model/3.weight: missing from the checkpoint" in message
    assert "optim/0.weight/exp_avg: this optimizer (SGD) has no such state" in message
