"""Checkpoints that loaded but should not (issue 32 items 8, 11, 12): NaN in `extra` (save
refuses it, so load must too), optimizer state that would wreck training (lr 1e308, no param
groups, another optimizer's state), and a flipped data bit whose error must say which file
and why on its first line. Each refusal changes nothing."""

import json
import os

import pytest
import torch

from moe.checkpoint import CheckpointError, checkpoint_dir, load_checkpoint, save_checkpoint
from moe.memory import GroupedApply
from tests.test_checkpoint_faults import (
    KEY,
    chunk,
    model_and_opt,
    refused,
    saved,
    write_metadata,
)


def test_nan_in_extra_is_refused_like_save_refuses_it(tmp_path):
    model, opt = model_and_opt()
    with pytest.raises(ValueError, match="extra must be JSON"):
        save_checkpoint(str(tmp_path / "nan"), model, opt, extra={"loss": float("nan")})
    directory, doc = saved(tmp_path)
    for bad in (float("nan"), float("inf"), float("-inf")):
        doc["objects"]["extra"] = {"history": [1.0, {"loss": bad}]}
        write_metadata(directory, json.dumps(doc))  # as Python's json writes them
        refused(tmp_path, r"extra\.history\[1\]\.loss is -?(NaN|Infinity), not a finite number")
    text = json.dumps(doc).replace("-Infinity", "1e999")  # overflows to inf when parsed
    write_metadata(directory, text)
    refused(tmp_path, r"extra\.history\[1\]\.loss is 1e999, not a finite number")


@pytest.mark.parametrize("grouped", [False, True])
def test_optimizer_state_that_would_wreck_training_is_refused(tmp_path, grouped):
    directory, doc = saved(tmp_path, grouped=grouped)
    original = json.loads(json.dumps(doc))
    groups = doc["objects"]["optimizer"]["param_groups"]
    groups[0]["lr"] = 1e308  # one step later the parameters are not finite
    write_metadata(directory, doc)
    refused(tmp_path, r"lr: must be at most 10000, got 1e\+308", grouped=grouped)
    doc["objects"]["optimizer"]["param_groups"] = []
    write_metadata(directory, doc)
    refused(tmp_path, "param_groups: empty", grouped=grouped)
    doc = json.loads(json.dumps(original))
    doc["objects"]["optimizer"]["class"] = "SGD"
    write_metadata(directory, doc)
    refused(tmp_path, "holds the state of 'SGD', the optimizer given is 'AdamW'", grouped=grouped)
    write_metadata(directory, original)
    model, opt = model_and_opt(seed=3, grouped=grouped)
    load_checkpoint(str(tmp_path), model, opt)  # the untouched checkpoint still loads


def test_another_optimizer_is_refused_and_grouped_apply_counts_as_its_algorithm(tmp_path):
    model, opt = model_and_opt()
    save_checkpoint(str(tmp_path), model, opt)  # AdamW
    twin, _ = model_and_opt(seed=3)
    sgd = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match="'AdamW', the optimizer given is 'SGD'"):
        load_checkpoint(str(tmp_path), twin, sgd)
    grouped = GroupedApply(twin.named_parameters(), torch.optim.AdamW, 2, lr=1e-2)
    load_checkpoint(str(tmp_path), twin, grouped)  # the same algorithm, grouped
    save_checkpoint(str(tmp_path), twin, grouped)
    with open(os.path.join(checkpoint_dir(str(tmp_path)), "metadata.json")) as f:
        meta = json.load(f)
    assert meta["objects"]["optimizer"]["class"] == "AdamW"
    grouped_sgd = GroupedApply(twin.named_parameters(), torch.optim.SGD, 2, lr=0.1)
    with pytest.raises(CheckpointError, match="'AdamW', the optimizer given is 'SGD'"):
        load_checkpoint(str(tmp_path), twin, grouped_sgd)


def test_a_flipped_bit_names_the_file_and_the_cause_on_the_first_line(tmp_path):
    directory, doc = saved(tmp_path)
    c = chunk(doc)
    data = os.path.join(directory, c["file"])
    with open(data, "r+b") as f:
        f.seek(c["offset"] + 5)
        byte = f.read(1)
        f.seek(c["offset"] + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    message = refused(tmp_path, "checksum mismatch")
    first = message.splitlines()[0]
    assert data in first and "checksum mismatch" in first and KEY in first, message
    assert "Traceback" not in message and len(message.splitlines()) == 1, message
