"""Router-replay routes files are untrusted: a FIFO, a directory, a damaged header, deeply
nested layer metadata, a token naming one expert twice, non-finite weights and another rank's
file are each one error naming the file, raised by Routes.load or on entering replay_routing
(the same error on every gloo rank), before any layer changes."""

import json
import os
import struct
import threading

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import moe
from moe.trace.routes_file import RoutesFileError
from tests.distributed import run_ranks

D, F, E = 8, 12, 6


def build(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, D), moe.MoELayer(D, F, E, top_k=2, name="a"))


def recorded(tmp_path, tokens=7):
    model = build()
    with moe.record_routing(model) as routes:
        model(torch.randn(tokens, D))
    return model, routes, routes.save(tmp_path / "routes.safetensors")


def load_fifo(fifo):
    """Routes.load(fifo) with a writer waiting on the FIFO, so a load that opened it for
    reading gets an empty stream at once (and a wrong error) instead of blocking; the writer
    is released afterwards by a non-blocking reader. No time limit is involved."""
    writer = threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True)
    writer.start()
    try:
        return moe.Routes.load(fifo)
    finally:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer's open return
        writer.join()
        os.close(fd)


def refused(path, match):
    with pytest.raises(RoutesFileError, match=match) as e:
        load_fifo(path) if path.is_fifo() else moe.Routes.load(path)
    assert str(path) in str(e.value)


def test_special_files_are_refused(tmp_path):
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    refused(fifo, "is a FIFO, not a regular file")
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    refused(folder, "is a directory, not a regular file")
    refused(tmp_path / "missing.safetensors", "no such file")


def _with_header(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_damaged_headers_name_the_file(tmp_path):
    _, _, good = recorded(tmp_path)
    raw = good.read_bytes()
    cases = {
        raw[:5]: "header length -1 does not fit",
        struct.pack("<Q", 10**9) + raw[8:]: "header length 1000000000 does not fit",
        raw[:8] + b"{" * 2 + raw[10:]: "not valid JSON",
    }
    path = tmp_path / "bad.safetensors"
    for data, message in cases.items():
        path.write_bytes(data)
        refused(path, message)
    meta = {"format": "moe.routes/1", "layers": '{"1": 1}'}
    entry = {"dtype": "I64", "shape": [2, 2], "data_offsets": [0, 32]}
    _with_header(path, {"__metadata__": meta, "1/0/expert_ids_TK": entry}, b"\0" * 16)
    refused(path, "does not fit its offsets")
    _with_header(path, {"__metadata__": meta, "1/0/expert_ids_TK": {**entry, "dtype": "X"}})
    refused(path, "malformed header entry for '1/0/expert_ids_TK'")
    deep = {**meta, "layers": "[" * 100_000 + "]" * 100_000}
    _with_header(path, {"__metadata__": deep})
    refused(path, "layer list: JSON nested 100000 levels deep")
    _with_header(path, {"__metadata__": {**meta, "layers": '{"1": 1, "1": 2}'}})
    refused(path, "key '1' appears twice")
    _with_header(path, {"__metadata__": {**meta, "layers": "{}", "rank": "3", "world": "2"}})
    refused(path, "rank '3' of world '2' is not valid")


def _replay_refused(model, routes, match, **kwargs):
    with pytest.raises(ValueError, match=match), moe.replay_routing(model, routes, **kwargs):
        pass
    assert all(layer.route_replay is None for _, layer in moe.moe_layers(model))


def test_duplicate_ids_and_nonfinite_weights_are_refused_naming_the_file(tmp_path):
    model, routes, path = recorded(tmp_path)
    record = routes["1"][0]
    ids = record.expert_ids_TK.clone()
    ids[3, 1] = ids[3, 0]  # [e, e]: one expert twice
    save_file(
        {"1/0/expert_ids_TK": ids, "1/0/weights_TK": record.weights_TK},
        path,
        metadata={"format": "moe.routes/1", "layers": '{"1": 1}'},
    )
    where = f"routes file '{path}': 1: forward 0"
    _replay_refused(model, moe.Routes.load(path), f"^{where}: token 3 names one expert twice")
    weights = record.weights_TK.clone()
    weights[2, 0] = float("nan")
    save_file(
        {"1/0/expert_ids_TK": record.expert_ids_TK, "1/0/weights_TK": weights},
        path,
        metadata={"format": "moe.routes/1", "layers": '{"1": 1}'},
    )
    for replay_weights in (True, False):
        _replay_refused(
            model,
            moe.Routes.load(path),
            f"^{where}: the recorded weights are not all finite",
            weights=replay_weights,
        )


def test_one_process_replays_any_ranks_file(tmp_path):
    """Without torch.distributed a file's rank is not checked (e.g. to inspect rank 1's)."""
    model, routes, path = recorded(tmp_path)
    routes.rank, routes.world = 1, 2
    routes.save(path)
    loaded = moe.Routes.load(path)
    assert (loaded.rank, loaded.world) == (1, 2)
    with moe.replay_routing(model, loaded):
        model(torch.randn(7, D))


def _wrong_rank_body(rank, world, folder, wrong_on):
    model = build()
    with moe.record_routing(model) as routes:
        model(torch.randn(5 + rank, D))
    routes.save(f"{folder}/routes-{{rank}}.safetensors")
    torch.distributed.barrier()
    # rank `wrong_on` (or every rank when None) loads the other rank's file
    other = (rank + 1) % world if wrong_on in (None, rank) else rank
    loaded = moe.Routes.load(f"{folder}/routes-{other}.safetensors")
    with pytest.raises(ValueError) as e, moe.replay_routing(model, loaded):
        pass
    return str(e.value)


@pytest.mark.parametrize("wrong_on", [None, 1])
def test_another_ranks_file_is_refused_on_every_rank(wrong_on, tmp_path):
    errors = run_ranks(_wrong_rank_body, 2, str(tmp_path), wrong_on, timeout=30)
    if wrong_on is None:
        for rank, error in enumerate(errors):
            other = tmp_path / f"routes-{1 - rank}.safetensors"
            assert error == (
                f"routes file '{other}': recorded on rank {1 - rank} of 2, replayed on rank "
                f"{rank} of 2: each rank replays its own routes ({{rank}} in the file name)"
            )
    else:
        assert errors[0] == f"rank 1: {errors[1]}"
        assert errors[1].startswith(f"routes file '{tmp_path / 'routes-0.safetensors'}'")
