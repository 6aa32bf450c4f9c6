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
from moe.memory import GroupedApply

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


# ---- issue 26: saves that keep other files, locking, ids, untrusted metadata, validation


def test_save_writes_and_removes_only_its_own_entries(tmp_path):
    (tmp_path / "ckpt-best").mkdir()
    (tmp_path / "ckpt-best" / "weights.pt").write_bytes(b"mine")
    (tmp_path / "ckpt-beef").mkdir()  # a hex-looking name, still not the save's
    (tmp_path / "ckpt-epoch3.txt").write_text("notes")
    (tmp_path / ".tmp-notes").mkdir()
    ours_before = set(os.listdir(tmp_path))
    model, opt = model_and_opt()
    first = save_checkpoint(str(tmp_path), model, opt)
    second = save_checkpoint(str(tmp_path), model, opt)
    names = set(os.listdir(tmp_path))
    assert ours_before <= names
    assert (tmp_path / "ckpt-best" / "weights.pt").read_bytes() == b"mine"
    assert (tmp_path / "ckpt-epoch3.txt").read_text() == "notes"
    assert not os.path.exists(first) and os.path.isdir(second)  # the previous save is replaced
    assert names - ours_before == {"LATEST", os.path.basename(second)}
    load_checkpoint(str(tmp_path), *model_and_opt(seed=5))


def test_stale_staging_of_a_killed_save_is_removed(tmp_path):
    model, opt = model_and_opt()
    save_checkpoint(str(tmp_path), model, opt)
    stale = tmp_path / ".tmp-0123456789abcdef"  # as a killed save leaves it: marker inside
    stale.mkdir()
    (stale / ".moe-staging").touch()
    (stale / "data-00000.bin").write_bytes(b"x")
    unmarked = tmp_path / ".tmp-fedcba9876543210"
    unmarked.mkdir()
    save_checkpoint(str(tmp_path), model, opt)
    assert not stale.exists() and unmarked.is_dir()


def test_ids_do_not_depend_on_the_seeded_rng(tmp_path):
    """The same seeded script saving twice to one path (it used to fail with 'Directory not
    empty'); a save does not consume the user's random numbers."""
    model, opt = model_and_opt()
    for _ in range(2):
        torch.manual_seed(0)
        before = torch.get_rng_state()
        save_checkpoint(str(tmp_path), model, opt)
        assert torch.equal(torch.get_rng_state(), before)
    load_checkpoint(str(tmp_path), *model_and_opt(seed=5))


HOLDER = """
import sys
from moe.checkpoint.folder import FolderLock
lock = FolderLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
sys.stdin.readline()
"""


def test_concurrent_save_is_a_clear_error_never_a_lost_save(tmp_path):
    """Another process saving into the folder (holding its lock): this save refuses before
    writing anything; once the other has finished, saving works."""
    model, opt = model_and_opt()
    save_checkpoint(str(tmp_path), model, opt, extra={"step": 1})
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        listing = sorted(os.listdir(tmp_path))
        with pytest.raises(CheckpointError, match="another save into .* is in progress"):
            save_checkpoint(str(tmp_path), model, opt, extra={"step": 2})
        assert sorted(os.listdir(tmp_path)) == listing
    finally:
        holder.communicate("\n", timeout=60)
    save_checkpoint(str(tmp_path), model, opt, extra={"step": 3})
    assert load_checkpoint(str(tmp_path), *model_and_opt(seed=5))["step"] == 3


def test_metadata_that_is_no_regular_file_is_refused(tmp_path):
    directory, _ = saved(tmp_path)
    path = os.path.join(directory, "metadata.json")
    os.remove(path)
    os.mkfifo(path)  # used to block forever
    refused(tmp_path, "metadata.json.: is a FIFO, not a regular file")
    os.remove(path)
    os.symlink("/dev/zero", path)  # used to raise MemoryError after 2.4 GB
    refused(tmp_path, "resolves to '/dev/zero', outside")
    os.remove(path)
    os.mkfifo(os.path.join(tmp_path, "LATEST.fifo"))
    os.replace(os.path.join(tmp_path, "LATEST.fifo"), os.path.join(tmp_path, "LATEST"))
    refused(tmp_path, "LATEST.: is a FIFO")


def test_deeply_nested_or_duplicated_metadata_is_one_error(tmp_path):
    directory, doc = saved(tmp_path)
    doc["objects"]["extra"] = "PLACEHOLDER"
    deep = "[" * 5000 + "]" * 5000  # RecursionError before
    write_metadata(directory, json.dumps(doc).replace('"PLACEHOLDER"', deep))
    refused(tmp_path, "metadata.json.: JSON nested 5002 levels deep")
    doc["objects"]["extra"] = {}
    write_metadata(directory, json.dumps(doc)[:-1] + ', "version": 3}')
    refused(tmp_path, "key 'version' appears twice")


def test_many_small_chunks_load_in_linear_time(tmp_path):
    """16,000 one-element chunks (the pairwise overlap test took 92 s on them): they load
    and give the right values; one overlapping chunk among them is found."""
    n = 16_000
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(n, 1))
    save_checkpoint(str(tmp_path), model)
    directory = checkpoint_dir(str(tmp_path))
    with open(os.path.join(directory, "metadata.json")) as f:
        doc = json.load(f)
    whole = chunk(doc, "model/0.weight")
    with open(os.path.join(directory, whole["file"]), "rb") as f:
        f.seek(whole["offset"])
        data = f.read(whole["length"])
    doc["tensors"]["model/0.weight"]["chunks"] = [
        dict(whole, offsets=[i, 0], sizes=[1, 1], offset=whole["offset"] + 4 * i, length=4,
             crc32=zlib.crc32(data[4 * i : 4 * i + 4]))
        for i in range(n)
    ]  # fmt: skip
    write_metadata(directory, doc)
    twin = nn.Sequential(nn.Embedding(n, 1))
    load_checkpoint(str(tmp_path), twin)
    assert torch.equal(twin[0].weight, model[0].weight)
    doc["tensors"]["model/0.weight"]["chunks"][-1]["offsets"] = [n - 2, 0]
    write_metadata(directory, doc)
    with pytest.raises(CheckpointError, match=r"chunks at \[15998, 0\] overlap"):
        load_checkpoint(str(tmp_path), twin)


@pytest.mark.parametrize(
    "group_key,value,match",
    [
        ("lr", float("nan"), r"param_groups\[0\]\.lr is NaN, not a finite number"),
        ("lr", 1e308, r"param_groups\[0\]\.lr: must be at most 10000, got 1e\+308"),
        ("lr", "0.1", "param_groups.0..lr: expected a number"),
        ("lr", -1.0, "lr: must be >= 0"),
        ("betas", [0.9], "betas: expected a list of 2 values"),
        ("betas", [0.9, 1.5], "betas must lie in"),
        ("eps", float("inf"), r"param_groups\[0\]\.eps is Infinity, not a finite number"),
        ("amsgrad", 1, "amsgrad: expected bool"),
    ],
)
@pytest.mark.parametrize("grouped", [False, True])
def test_bad_optimizer_hyperparameters_refused_before_any_change(
    tmp_path, group_key, value, match, grouped
):
    directory, doc = saved(tmp_path, grouped=grouped)
    doc["objects"]["optimizer"]["param_groups"][0][group_key] = value
    write_metadata(directory, json.dumps(doc))  # NaN / Infinity as Python's json writes them
    refused(tmp_path, match, grouped=grouped)


@pytest.mark.parametrize("grouped", [False, True])
def test_bad_json_optimizer_state_refused_before_any_change(tmp_path, grouped):
    directory, doc = saved(tmp_path, grouped=grouped)
    doc["objects"]["optimizer"]["state_values"] = {"0.weight": {"step": "abc"}}
    write_metadata(directory, doc)
    refused(tmp_path, "optimizer state 0.weight/step", grouped=grouped)
    doc["objects"]["optimizer"]["state_values"] = {"9.weight": {"x": 1}}
    write_metadata(directory, doc)
    refused(tmp_path, "'9.weight': not a parameter", grouped=grouped)


def _moe_model(seed: int, **options):
    import moe

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), moe.MoELayer(6, 10, 4, **options))


def test_moe_settings_travel_with_the_checkpoint(tmp_path):
    saved_model = _moe_model(0, top_k=2, router="topk", activation="gelu", backend="torch")
    save_checkpoint(str(tmp_path), saved_model)
    other = _moe_model(1, top_k=1, router="switch", activation="relu")
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(tmp_path), other)
    message = str(info.value)
    for field, ours, theirs in [("top_k", 2, 1), ("router", "'topk'", "'switch'"),
                                ("activation", "'gelu'", "'relu'")]:  # fmt: skip
        assert f"MoE layer '1': {field}={ours} in the checkpoint, {field}={theirs}" in message
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    load_checkpoint(str(tmp_path), other, allow_config_change=True)
    assert torch.equal(other[1].experts.w1, saved_model[1].experts.w1)
    same = _moe_model(2, top_k=2, router="topk", activation="gelu", backend="auto")
    load_checkpoint(str(tmp_path), same)  # how a layer runs (backend) may differ
    directory = checkpoint_dir(str(tmp_path))
    with open(os.path.join(directory, "metadata.json")) as f:
        doc = json.load(f)
    del doc["objects"]["moe_layers"]  # a checkpoint of an older release
    write_metadata(directory, doc)
    load_checkpoint(str(tmp_path), _moe_model(3, top_k=1, router="switch", activation="relu"))
