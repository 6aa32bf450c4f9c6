"""`python -m moe.plan` and `python -m moe.plan profile` as a newcomer meets them (issue 63,
issue 62 items 12 and 13): the model names as printed, the model's own sequence length, a
line naming whose device figures a plan used, and every bad value one error with its bounds
(exit status 2) before any search or measurement."""

import json

import pytest

from moe.plan import cli, profile

TINY = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 8, "num_experts_per_tok": 2}  # fmt: skip


@pytest.fixture
def no_search(monkeypatch):
    def searched(*_, **__):
        raise AssertionError("the search ran before the arguments were checked")

    monkeypatch.setattr(cli, "search", searched)


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_m6_names_as_printed_and_the_models_sequence_length(capsys):
    assert cli.main(["--model", "m6-tiny", "--tokens", "14K", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "sequences of 28;" in out  # m6-tiny: 16 patches + 12 text tokens
    assert "device figures: h100, datasheet preset" in out and "not this machine's" in out
    line = _refused(["--model", "m6-m6-tiny", "--tokens", "14K"], capsys)
    assert "unknown model 'm6-m6-tiny'" in line and "m6-tiny, m6-tiny-gpu" in line


def test_a_measured_cluster_is_named_as_the_plans_figures(tmp_path, capsys):
    from moe.plan import preset

    path = tmp_path / "cluster.json"
    preset("h100").with_nodes(1, 2).save(path)  # any cluster file: its path and source named
    argv = ["--model", "mixtral-tiny", "--cluster", str(path), "--tokens", "4K", "--top", "1",
            "--seq-len", "64"]  # fmt: skip
    assert cli.main(argv) == 0
    assert f"device figures: {path} (" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hidden_layers": None}, "has no num_hidden_layers"),
        ({"hidden_size": None}, "has no hidden_size"),
        ({"vocab_size": None}, "has no vocab_size"),
        ({"num_attention_heads": None}, "has no num_attention_heads"),
        ({"hidden_size": "4096"}, "hidden_size must be an integer in [1, 131,072], got '4096'"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer in [1, 1,024], got 0"),
        ({"num_hidden_layers": 1e9}, "num_hidden_layers must be an integer in [1, 1,024]"),
        ({"num_hidden_layers": 10**9}, "got 1000000000"),
        ({"num_local_experts": True}, "num_local_experts must be an integer"),
    ],
)
def test_a_bad_model_config_is_one_error_before_the_search(tmp_path, capsys, no_search,
                                                           change, message):  # fmt: skip
    config = {k: v for k, v in {**TINY, **change}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    line = _refused(["--model", str(path), "--tokens", "4K"], capsys)
    assert message in line, line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu-mem", "1e300"], "--gpu-mem: must be in (0, 1.04858e+06], got '1e300'"),
        (["--gpu-mem", "nan"], "--gpu-mem: must be in (0,"),
        (["--skew", "1e308"], "--skew: must be in [0, 10], got '1e308'"),
        (["--skew", "-1"], "--skew: must be in [0, 10]"),
        (["--tokens", "99999999999999999999999G"], "--tokens: must be in [1, 2**50]"),
        (["--tokens", "0"], "--tokens: must be in [1, 2**50], got '0'"),
        (["--capacity-factor", "1e-300"], "--capacity-factor: must be in [0.1, 10000]"),
        (["--nodes", "0"], "--nodes: must be in (0, 65536], got '0'"),
        (["--top", "1000"], "--top: must be in (0, 100]"),
        (["--seq-len", "-5"], "--seq-len: must be in (0,"),
        (["--json", "{tmp}/missing/p.json"], "the folder"),
        (["--json", "{tmp}"], "is a directory, not a file to write"),
        (["--plot", "/"], "--plot '/' is a directory"),
    ],
)
def test_bad_flags_are_one_error_before_the_search(tmp_path, capsys, no_search, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    line = _refused(["--model", "mixtral-tiny", "--tokens", "4K", *argv], capsys)
    assert message in line, line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--d-model", "0"], "--d-model: must be in (0, 65536], got '0'"),
        (["--d-ff", "0"], "--d-ff: must be in (0, 65536]"),
        (["--tokens", "0"], "--tokens: must be in (0, 65536]"),
        (["--d-model", "100000000"], "--d-model: must be in (0, 65536]"),
        (["--device-mem", "-4"], "--device-mem: must be in (0,"),
        (["--device-mem", "inf"], "--device-mem: must be in (0,"),
        (["--device-mem", "x"], "--device-mem: not a float: 'x'"),
        (["--out", "/"], "--out '/' is a directory, not a file to write"),
        (["--out", "{tmp}/missing/cluster.json"], "/missing' does not exist"),
    ],
)
def test_profile_checks_every_flag_before_measuring(tmp_path, capsys, monkeypatch, argv, message):
    def measured(*_):
        raise AssertionError("a measurement ran before the arguments were checked")

    monkeypatch.setattr(profile, "_profile", measured)
    argv = [a.format(tmp=tmp_path) for a in argv]
    argv = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "c.json")]
    line = _refused(["profile", *argv], capsys)
    assert message in line, line
