"""Manifest attacks on checkpoint loading: path traversal, memory bombs, optimizer state of the
wrong shape and malformed manifests all raise CheckpointError naming what is wrong, before
any weight or optimizer state is changed."""

import json
import os
import zlib

import pytest
import torch

from moe.checkpoint import CheckpointError
from moe.parallel import load_checkpoint
from tests.test_checkpoint import assert_untouched_after_error, saved

EXPERT_KEY = "model/blocks.1.ffn.experts.w2#expert=3"


def rewrite(directory: str, manifest: dict) -> None:
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/dev/zero", "..", "sub/data.bin"])
def test_data_file_outside_the_checkpoint_is_refused(tmp_path, name):
    directory, manifest = saved(tmp_path)
    manifest["tensors"][EXPERT_KEY]["file"] = name
    rewrite(directory, manifest)
    message = assert_untouched_after_error(tmp_path, "not a plain file name|outside")
    assert EXPERT_KEY in message and name in message


def test_symlink_leading_out_is_refused(tmp_path):
    directory, manifest = saved(tmp_path)
    os.symlink("/etc/passwd", os.path.join(directory, "data-evil.bin"))
    manifest["tensors"][EXPERT_KEY]["file"] = "data-evil.bin"
    rewrite(directory, manifest)
    message = assert_untouched_after_error(tmp_path, "resolves outside the checkpoint")
    assert EXPERT_KEY in message


def test_latest_pointer_outside_is_refused(tmp_path):
    saved(tmp_path)
    (tmp_path / "LATEST").write_text("ckpt-../../etc")
    assert_untouched_after_error(tmp_path, "not a checkpoint directory")


def test_huge_declared_size_is_refused_before_allocating(tmp_path):
    directory, manifest = saved(tmp_path)
    entry = manifest["tensors"][EXPERT_KEY]
    entry["shape"], entry["nbytes"] = [2**34], 2**36  # 64 GiB of float32
    rewrite(directory, manifest)
    message = assert_untouched_after_error(tmp_path, "truncated|shape")
    assert EXPERT_KEY in message
    entry["shape"], entry["nbytes"] = [4], 2**36  # a size that disagrees with dtype x shape
    rewrite(directory, manifest)
    message = assert_untouched_after_error(tmp_path, "declares 68719476736 bytes")
    assert EXPERT_KEY in message


def test_optimizer_state_of_the_wrong_shape_is_refused(tmp_path):
    directory, manifest = saved(tmp_path)
    key = next(k for k in manifest["tensors"] if k.startswith("optim/") and "exp_avg#" in k)
    entry = manifest["tensors"][key]
    data = torch.randn(2).numpy().tobytes()  # float32[2] with a matching checksum
    path = os.path.join(directory, entry["file"])
    entry.update(offset=os.path.getsize(path), nbytes=len(data), shape=[2], crc32=zlib.crc32(data))
    with open(path, "ab") as f:
        f.write(data)
    rewrite(directory, manifest)
    message = assert_untouched_after_error(tmp_path, "does not fit its parameter")
    assert key in message


def _mutations(manifest: dict):
    key = EXPERT_KEY
    yield "a list", [], "not a JSON object"
    yield "version 2", {**manifest, "version": 2}, "not a moe-checkpoint v1"
    yield "no tensors", {k: v for k, v in manifest.items() if k != "tensors"}, "'tensors'"
    yield "tensors list", {**manifest, "tensors": []}, "'tensors' must be an object"
    for field, value, message in [
        ("dtype", None, "'dtype' must be str"),
        ("dtype", "torch.complex64", "unsupported dtype"),
        ("shape", [-1, 4], "bad shape"),
        ("shape", "4", "'shape' must be list"),
        ("offset", -8, "offset -8"),
        ("offset", 1.5, "'offset' must be int"),
        ("kind", "exec", "has kind 'exec'"),
        ("expert", -1, "'expert' must be an int >= 0"),
        ("python", "eval", "'python' is 'eval'"),
        ("crc32", None, "'crc32' must be int"),
    ]:
        entry = {**manifest["tensors"][key], field: value}
        yield (
            f"{field}={value!r}",
            {**manifest, "tensors": {**manifest["tensors"], key: entry}},
            (message),
        )
    entry = {k: v for k, v in manifest["tensors"][key].items() if k != "name"}
    yield "no name", {**manifest, "tensors": {key: entry}}, "'name' must be str"
    yield "optimizer list", {**manifest, "optimizer": []}, "'optimizer' must be an object"
    yield "extra str", {**manifest, "extra": "x"}, "'extra' must be an object"


def test_malformed_manifests_are_one_clear_error(tmp_path):
    directory, manifest = saved(tmp_path)
    cases = list(_mutations(manifest))
    assert len(cases) >= 15
    for what, mutated, message in cases:
        rewrite(directory, mutated)
        try:
            assert_untouched_after_error(tmp_path, message)
        except BaseException as e:
            raise AssertionError(f"manifest with {what}: {e}") from e
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        f.write('{"format": "moe-checkpoint", "version": 1, "tensors": {')  # not JSON
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(str(tmp_path), torch.nn.Linear(1, 1))
