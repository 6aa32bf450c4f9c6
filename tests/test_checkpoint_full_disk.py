"""A full disk during moe.checkpoint.save_checkpoint (issue 49 item 10): one CheckpointError
naming the reason, nothing of the failed save left in the folder (no .tmp-* staging folder,
no LATEST.tmp, no unpublished ckpt-*), the previous checkpoint intact and loadable."""

import errno
import os

import pytest
import torch

from moe.checkpoint import CheckpointError, api, load_checkpoint, save_checkpoint, storage


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _entries(path):
    return sorted(os.listdir(path))


@pytest.mark.parametrize("where", ["write", "publish"])
def test_a_full_disk_fails_the_save_cleanly(tmp_path, monkeypatch, where):
    model = _model()
    first = save_checkpoint(str(tmp_path), model, extra={"step": 1})
    before = _entries(tmp_path)
    with torch.no_grad():
        model.weight.add_(1.0)
    if where == "write":  # part of the rank's bytes written, then ENOSPC

        def write_data(self, plan, planner):
            with open(os.path.join(self.directory, "data-00000.bin"), "wb") as f:
                f.write(b"\0" * 10)
            _enospc()

        monkeypatch.setattr(storage.JsonStorageWriter, "write_data", write_data)
    else:  # the staging folder renamed to ckpt-<id>, then LATEST cannot be replaced
        real = os.replace
        monkeypatch.setattr(
            api.os, "replace", lambda a, b: _enospc() if b.endswith("LATEST") else real(a, b)
        )
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(str(tmp_path), model, extra={"step": 2})
    message = str(e.value)
    assert "no space left on device (errno 28: ENOSPC)" in message, message
    assert f"the previous checkpoint {os.path.basename(first)} is intact" in message
    assert "\n" not in message
    monkeypatch.undo()
    assert _entries(tmp_path) == before  # nothing partial: no .tmp-*, LATEST.tmp, ckpt-*
    fresh = torch.nn.Linear(4, 3)
    assert load_checkpoint(str(tmp_path), fresh) == {"step": 1}
    assert torch.equal(fresh.weight, _model().weight)
