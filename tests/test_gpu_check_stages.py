"""The GPU check's rerun and cut-off handling (bench/gpu_check.py, bench/gpu_check_stages.py):
--stages reruns chosen stages, and a pytest run cut off at its limit still names its failures
(the first GPU run, 2026-11-28, lost its 10 failures' names that way)."""

import pytest

from bench import gpu_check, gpu_check_stages
from tests.test_gpu_check import _fake_stages


def test_stages_reruns_only_the_chosen_ones(tmp_path, monkeypatch, capsys):
    """--stages abf (the rerun of the first GPU run): c and d are reported as not selected, not
    as skipped, and the budget asked for is the chosen stages' sum; other letters are refused."""
    ran = []
    _fake_stages(monkeypatch, {k: (lambda check, limit, k=k: ran.append(k) or ("passed", ""))
                               for k in "abcdf"})  # fmt: skip
    assert gpu_check.main(["--stages", "abf", "--budget", "320", "--out", str(tmp_path)]) == 0
    assert ran == ["a", "b", "f"]
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| c | layer benchmark at four shapes | not selected |" in md
    for bad, why in (("abx", "--stages takes letters of abcdf"), ("ab", "less than the 195 s")):
        with pytest.raises(SystemExit):
            gpu_check.main(["--stages", bad, "--budget", "100", "--out", str(tmp_path / "o")])
        assert why in capsys.readouterr().err


def test_a_cut_off_pytest_run_still_names_its_failures(tmp_path, monkeypatch):
    """Stage b's pytest runs with -v: a run killed at its limit (no summary line) still gives
    the failing tests' names."""
    check = gpu_check.Check(tmp_path, 600, rehearse=False, carry=tmp_path)
    out = ("[gw1] [ 10%] PASSED tests/test_cuda.py::test_a\n"
           "[gw0] [ 20%] FAILED tests/test_cutlass_roles.py::test_b[up]\n"
           "[gw2] [ 30%] ERROR tests/test_cuda.py::test_c\n")  # fmt: skip
    argvs = []
    monkeypatch.setattr(
        check, "run", lambda label, argv, limit, env: argvs.append(argv) or (None, out)
    )
    assert (
        gpu_check_stages._pytest(check, "b", "pointer path", ["tests/x.py"], 10, tma=False) is None
    )
    assert "-v" in argvs[0]
    names = {r["name"]: r["value"] for r in check.rows}
    assert names["pointer path failing tests"] == (
        "tests/test_cuda.py::test_c, tests/test_cutlass_roles.py::test_b[up]"
    )
