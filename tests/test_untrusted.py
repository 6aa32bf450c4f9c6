"""moe.untrusted: the one reader of untrusted files (checkpoint metadata, HF indexes, MoE
settings, cost profiles): regular files only, bounded size, JSON parsed in linear time and
bounded depth, no duplicate keys, one error naming the file."""

import json
import os

import pytest

from moe.comm.cost_model import load_profile
from moe.untrusted import UntrustedFileError, json_depth, parse_json, read_bytes, read_json


class Refused(ValueError):
    pass


def test_only_regular_files_are_opened(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it for reading without O_NONBLOCK would block forever
    with pytest.raises(Refused, match=r"settings '.*fifo.json': is a FIFO, not a regular file"):
        read_json(fifo, 100, error=Refused, what="settings")
    with pytest.raises(UntrustedFileError, match="is a character device"):
        read_bytes("/dev/zero", 100)
    with pytest.raises(UntrustedFileError, match="is a directory"):
        read_bytes(tmp_path, 100)
    with pytest.raises(UntrustedFileError, match="no such file"):
        read_bytes(tmp_path / "missing", 100)
    (tmp_path / "inner").mkdir()
    (tmp_path / "secret").write_text("{}")
    os.symlink(tmp_path / "secret", tmp_path / "inner" / "link.json")
    with pytest.raises(UntrustedFileError, match="outside"):
        read_json(tmp_path / "inner" / "link.json", 100, root=tmp_path / "inner")
    assert read_json(tmp_path / "inner" / "link.json", 100) == {}  # no directory: link is fine


def test_size_is_checked_before_reading(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps(list(range(100))))
    with pytest.raises(UntrustedFileError, match="larger than the limit of 10 bytes"):
        read_json(path, 10)
    assert read_json(path, 1000) == list(range(100))


def test_depth_is_counted_outside_strings_without_recursion():
    assert json_depth(b'{"a": "[[[{{{\\"[[", "b": [[1], {"c": []}]}') == 4
    assert json_depth(b"[]" * 1000) == 1 and json_depth(b"7") == 0
    deep = b"[" * 100_000 + b"]" * 100_000  # json.loads: RecursionError
    with pytest.raises(UntrustedFileError, match="x: JSON nested 100000 levels deep"):
        parse_json(deep, "x")
    assert parse_json(b"[" * 64 + b"]" * 64, "x", max_depth=64) is not None


def test_one_error_for_every_malformed_document():
    cases = {
        b'{"a": 1, "a": 2}': "key 'a' appears twice in one JSON object",
        b'{"a": {"b": 1, "b": 1}}': "key 'b' appears twice",
        b"\xff\xfe": "not UTF-8",
        b"[1, 2": "not valid JSON",
        b"1" * 5000: "an integer of 5000 digits",
    }
    for data, match in cases.items():
        with pytest.raises(Refused, match=f"doc: {match}"):
            parse_json(data, "doc", error=Refused)


def test_cost_profile_is_read_as_untrusted(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"version": 1, "model": ' + "[" * 100 + "]" * 100 + "}")
    with pytest.raises(ValueError, match=r"cost profile '.*profile.json': JSON nested 101"):
        load_profile(path)
    path.write_text('{"version": 1, "version": 1, "model": {}}')
    with pytest.raises(ValueError, match="key 'version' appears twice"):
        load_profile(path)


def test_proc_files_whose_reads_fail_are_an_error_naming_the_file(monkeypatch):
    """/proc/self/mem is a regular file of size 0 whose reads fail with EIO (issue 32 item 10):
    as the cost profile (MOE_A2A_COST_PROFILE) and as a routing trace."""
    from moe.comm import cost_model
    from moe.trace.routing_trace import read_trace

    mem = "/proc/self/mem"
    with pytest.raises(ValueError, match=r"cost profile '/proc/self/mem': cannot read: "):
        load_profile(mem)
    monkeypatch.setenv("MOE_A2A_COST_PROFILE", mem)
    with pytest.raises(ValueError, match=r"cost profile '/proc/self/mem': cannot read: "):
        cost_model("gloo")
    with pytest.raises(ValueError, match=r"routing trace '/proc/self/mem': cannot read: "):
        read_trace(mem)
    with pytest.raises(Refused, match=r"'/proc/self/mem': cannot read: "):
        read_bytes(mem, 100, error=Refused)
    assert read_bytes("/proc/self/status", 1 << 20).startswith(b"Name:")  # size 0, readable


def test_json_numbers_are_finite_and_integers_short(tmp_path):
    """NaN and infinities are not JSON (Python's json accepts them): refused, naming where;
    an integer of 401 digits overflows a float (the cost profile's OverflowError) and costs
    quadratic time to parse: refused by length."""
    cases = {
        b'{"a": [1, {"b": NaN}]}': r"a\[1\]\.b is NaN, not a finite number",
        b'{"x": -Infinity}': r"x is -Infinity, not a finite number",
        b'{"x": 1e999}': r"x is 1e999, not a finite number",
        b'{"x": ' + b"1" * 401 + b"}": "an integer of 401 digits",
    }
    for data, match in cases.items():
        with pytest.raises(Refused, match=match):
            parse_json(data, "doc", error=Refused)
    big = -(2**64 - 1)  # 20 digits: safetensors offsets are u64
    assert parse_json(f'{{"n": {big}, "f": 1.5e300}}'.encode(), "doc") == {"n": big, "f": 1.5e300}
    profile = tmp_path / "profile.json"
    model = {k: 1 for k in ("a_coll", "a_intra", "a_inter", "a_ring")}
    model |= {k: 1e9 for k in ("bw_intra", "bw_inter", "bw_copy")}
    model["a_coll"] = int("1" * 401)
    text = json.dumps({"version": 1, "model": model})
    profile.write_text(text)
    with pytest.raises(ValueError, match=r"cost profile '.*profile.json': an integer of 401"):
        load_profile(profile)
