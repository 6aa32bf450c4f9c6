"""The GPU check's CPU-testable parts: the budget (a stage that does not fit is skipped and named,
the report is written when a stage fails), the decision rules of issue 35 on synthetic records,
the GEMM-role table, and the M6 example's --max-seconds / --count-syncs."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench import gpu_check, gpu_check_stages, gpu_decide
from examples.m6 import train
from moe.kernels import gemm_roles


def _fake_stages(monkeypatch, behaviour):
    for key, fn in behaviour.items():
        monkeypatch.setattr(gpu_check_stages, f"stage_{key}", fn, raising=True)
    monkeypatch.setattr(gpu_check_stages, "decide", lambda check: ["decided"])


def test_budget_skips_what_does_not_fit_and_the_report_survives_a_failure(tmp_path, monkeypatch):
    ran = []

    def passes(key):
        return lambda check, limit: ran.append(key) or ("passed", f"limit {limit}")

    def boom(check, limit):
        ran.append("b")
        raise RuntimeError("stage b broke")

    fakes = {"a": passes("a"), "b": boom, "c": passes("c"), "d": passes("d"), "f": passes("f")}
    _fake_stages(monkeypatch, fakes)
    # in 155 s: a (45 s) and b (150 s) fit (the fakes take no time), c (160 s) does not, d (80 s)
    # and f (120 s) do
    check = gpu_check.Check(tmp_path, 155, rehearse=False, carry=tmp_path / "none")
    assert check.main() == 1
    assert ran == ["a", "b", "d", "f"]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    status = {s["stage"]: (s["status"], s["detail"]) for s in report["stages"]}
    assert status["b"] == ("failed", "RuntimeError: stage b broke")
    assert status["c"][0] == "skipped" and "needs 160 s" in status["c"][1]
    assert status["d"] == ("passed", "limit 80") and status["f"] == ("passed", "limit 120")
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| c | layer benchmark at four shapes | skipped |" in md and "decided" in md


def test_rehearsal_fails_on_a_skipped_stage(tmp_path, monkeypatch):
    ok = lambda check, limit: ("passed", "")  # noqa: E731
    _fake_stages(monkeypatch, {k: ok for k in "abcdf"})
    assert gpu_check.Check(tmp_path, 1000, rehearse=True, carry=tmp_path).main() == 0
    assert gpu_check.Check(tmp_path, 200, rehearse=True, carry=tmp_path).main() == 1  # c: 300 s


def _rec(shape, candidate, value, figure="fwd_bwd_ms", d=2048, F=1024):
    return {
        "shape": shape,
        "candidate": candidate,
        "figure": figure,
        "value": value,
        "d": d,
        "F": F,
    }


def test_tma_rule_needs_correctness_and_three_of_four_shapes():
    shapes = ["Mixtral", "OLMoE", "Qwen3", "DeepSeek"]
    recs = [_rec(s, "moe triton", 10.0) for s in shapes]
    three = recs + [_rec(s, "moe triton TMA", 9.0 if i < 3 else 11.0) for i, s in enumerate(shapes)]
    two = recs + [_rec(s, "moe triton TMA", 9.0 if i < 2 else 11.0) for i, s in enumerate(shapes)]
    assert gpu_decide.tma_decision(three, True)[0] is True
    assert gpu_decide.tma_decision(two, True)[0] is False
    assert gpu_decide.tma_decision(three, False)[0] is False
    assert gpu_decide.tma_decision(three, None)[0] is False


def test_role_rule_moves_a_role_only_past_the_margin_at_every_shape_of_its_class():
    def role(shape, name, backend, ms, d=2048, F=1024):
        return _rec(shape, f"role {name} {backend}", ms, figure="ms", d=d, F=F)

    recs = [
        role("OLMoE", "up", "triton", 1.10), role("OLMoE", "up", "cutlass", 1.0),  # 10% slower
        role("Qwen3", "up", "triton", 1.10), role("Qwen3", "up", "cutlass", 1.0),
        role("OLMoE", "down", "triton", 1.04), role("OLMoE", "down", "cutlass", 1.0),  # 4%
        role("OLMoE", "dx", "triton", 1.2), role("OLMoE", "dx", "cutlass", 1.0),
        role("Qwen3", "dx", "triton", 0.9), role("Qwen3", "dx", "cutlass", 1.0),  # one shape wins
        role("Mixtral", "up TMA", "triton", 9.0), role("Mixtral", "up", "cutlass", 1.0, 4096, 14336),
    ]  # fmt: skip
    table, changes = gpu_decide.role_decision(recs)
    for untested in (None, False):  # the CUDA tests of the CUTLASS roles did not pass
        kept, why = gpu_decide.role_decision(recs, untested)
        assert kept == gemm_roles.TABLE and "(stage b)" in why[0], why
    assert table[("up", "narrow")] == "cutlass"
    assert table[("down", "narrow")] == table[("dx", "narrow")] == "triton"
    assert table[("up", "wide-ffn")] == "triton"  # no Triton time for plain "up" there
    assert len(changes) == 1 and changes[0].startswith("up at narrow: triton -> cutlass")


def test_role_rule_compares_the_tma_variant_once_tma_is_the_default():
    def role(name, backend, ms):
        return _rec("OLMoE", f"role {name} {backend}", ms, figure="ms")

    recs = [role("up", "triton", 1.0), role("up TMA", "triton", 1.2), role("up", "cutlass", 1.0),
            role("wgrad2", "triton", 1.2), role("wgrad2", "cutlass", 1.0)]  # fmt: skip
    pointer = gpu_decide.role_decision(recs, True, tma=False)[0]
    with_tma = gpu_decide.role_decision(recs, True, tma=True)[0]
    assert pointer[("up", "narrow")] == "triton" and with_tma[("up", "narrow")] == "cutlass"
    # a role without a TMA variant keeps its own Triton figure
    assert pointer[("wgrad2", "narrow")] == with_tma[("wgrad2", "narrow")] == "cutlass"


def test_role_table_covers_every_role_and_class_with_an_applied_backend():
    """Every (role, shape class) has an entry the Triton expert MLP applies (tests/
    test_cutlass_roles.py runs each role on either backend)."""
    assert set(gemm_roles.TABLE) == {
        (r, c) for r in gemm_roles.ROLES for c in gemm_roles.SHAPE_CLASSES
    }
    assert set(gemm_roles.TABLE.values()) <= set(gemm_roles.APPLIED)
    presets = {
        "Mixtral": (4096, 14336),
        "OLMoE": (2048, 1024),
        "Qwen3": (2048, 768),
        "DeepSeek": (7168, 2048),
    }
    classes = {n: gemm_roles.shape_class(*dims) for n, dims in presets.items()}
    assert classes == {
        "Mixtral": "wide-ffn",
        "OLMoE": "narrow",
        "Qwen3": "narrow",
        "DeepSeek": "wide-model",
    }
    assert gemm_roles.backend_for("dx", 2048, 1024) == "triton"
    with pytest.raises(ValueError, match="unknown GEMM role 'dw'"):
        gemm_roles.backend_for("dw", 2048, 1024)


def test_cutlass_layer_rows_compare_with_moe_triton():
    recs = [_rec("OLMoE", "moe triton", 14.5), _rec("OLMoE", "moe triton CUTLASS roles", 12.0),
            _rec("Qwen3", "moe triton", 12.8)]  # fmt: skip
    assert gpu_decide.cutlass_layer_rows(recs) == [
        "OLMoE: every role on CUTLASS 12.00 ms vs 14.50 ms"
    ]


def test_m6_rule_names_the_bound():
    assert gpu_decide.m6_decision(160_000, 30_000, 0.1)[0] is True
    keep, why = gpu_decide.m6_decision(100_000, 30_000, 3.0)
    assert not keep and "host syncs" in why
    keep, why = gpu_decide.m6_decision(100_000, 30_000, 0.1)
    assert not keep and "kernel launches" in why
    assert gpu_decide.m6_decision(None, 30_000, None) == (False, "not measured")


def test_cpu_m6_figure_comes_from_bench_results():
    tok_s, source = gpu_check_stages.cpu_m6_tokens_per_s()
    assert source.endswith("-cpu-m6.md") and tok_s > 1000


def test_m6_max_seconds_stops_and_evaluates(tmp_path):
    s = train.run(["--config", "m6-tiny", "--steps", "400", "--max-seconds", "0.01", "--count-syncs",
                   "--no-plots", "--quiet", "--run-dir", str(tmp_path)])  # fmt: skip
    assert s["out_of_time"] and s["steps_this_run"] == 1 and s["steps"] == 1
    assert "caption_accuracy" in s and s["host_syncs"] is None  # CPU: nothing to count


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_m6_max_seconds_is_validated(bad, capsys):
    assert train.main(["--config", "m6-tiny", "--max-seconds", bad, "--quiet"]) == 2
    assert "--max-seconds must be a finite number > 0" in capsys.readouterr().err


def test_m6_steady_tokens_per_s_leaves_out_the_first_read_back(tmp_path):
    s = train.run(["--config", "m6-tiny", "--steps", "6", "--log-every", "2", "--no-plots",
                   "--quiet", "--run-dir", str(tmp_path)])  # fmt: skip
    assert not s["out_of_time"] and s["steady_tokens_per_s"] > 0
    assert train._steady((2, 1.0), 6, 3.0, 100) == 200.0
    assert train._steady(None, 6, 3.0, 100) is None and train._steady((6, 1.0), 6, 3.0, 100) is None


def test_without_cuda_the_gpu_check_stops_after_stage_a(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA path")
    assert gpu_check.main(["--out", str(tmp_path), "--carry", str(tmp_path / "none")]) == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    status = [(s["stage"], s["status"], s["detail"]) for s in report["stages"]]
    assert status[0][:2] == ("a", "failed") and "CUDA is not available" in status[0][2]
    assert [s[1:] for s in status[1:]] == [("skipped", "no CUDA (stage a)")] * 4


def test_gpu_machine_installs_only_the_carried_wheels_it_lacks():
    wheels = ["w/deepspeed-0.19.8-py3-none-any.whl", "w/pytest-9.0-py3-none-any.whl",
              "w/py_cpuinfo-9.0.0-py3-none-any.whl", "w/no_such_module_xyz-1.0-py3-none-any.whl"]  # fmt: skip
    kept = gpu_check_stages._missing(wheels)
    assert kept[0] == wheels[0] and wheels[1] not in kept and wheels[3] in kept


def test_a_budget_that_fits_no_stage_is_refused(tmp_path, capsys):
    """--budget 44 (stage a needs 45 s) is one clear error, not exit 0 with every stage skipped
    (issue 41 item 9); a Check whose every stage was skipped exits 1 too."""
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--budget", "44", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--budget must be in [45, 3600)" in capsys.readouterr().err
    assert gpu_check.Check(tmp_path, 10, rehearse=False, carry=tmp_path).main() == 1
    assert "every stage was skipped" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
def test_an_out_folder_that_cannot_hold_the_report_is_one_error_line(tmp_path, capsys, where):
    """--out at a file, under a file or at /proc/x: one error line naming --out, no traceback."""
    (tmp_path / "f").write_text("a user's file")
    out = {"file": tmp_path / "f", "under_file": tmp_path / "f" / "x", "proc": "/proc/x"}[where]
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(out), "--budget", "560"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: --out {out}: cannot write the report" in err
    assert "Traceback" not in err and (tmp_path / "f").read_text() == "a user's file"


@pytest.mark.parametrize("dest", ["user_folder", "tutel", "inside_tutel", "file"])
def test_gpu_carry_never_deletes_a_folder_it_did_not_make(tmp_path, dest):
    """scripts/gpu_carry.sh TUTEL FOLDER refuses a non-empty FOLDER it did not make (a user's
    folder, the Tutel checkout itself), one inside the checkout, or a file, before any
    download, and leaves it as it was (issue 41 item 6)."""
    tutel = tmp_path / "tutel-src"
    (tutel / "tutel").mkdir(parents=True)
    (tutel / "setup.py").write_text("# setup")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    (tmp_path / "a-file").write_text("a user's file")
    folder = {"user_folder": tmp_path / "mine", "tutel": tutel,
              "inside_tutel": tutel / "carry", "file": tmp_path / "a-file"}[dest]  # fmt: skip
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_carry.sh"
    run = subprocess.run(
        ["bash", str(script), str(tutel), str(folder)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and run.stderr.startswith(f"error: {folder} ")
    assert "refusing to write there" in run.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "a user's file"
    assert (tmp_path / "a-file").read_text() == "a user's file"
    assert (tutel / "setup.py").read_text() == "# setup" and (tutel / "tutel").is_dir()
    assert not (tutel / "carry").exists()


def test_gpu_carry_replaces_only_its_own_files(tmp_path):
    """A missing FOLDER is made and marked; a second run into it replaces its wheels/ and tutel/
    and keeps a file the user put there (PYTHON=true: no download, the plumbing only)."""
    tutel = tmp_path / "tutel-src"
    (tutel / "tutel").mkdir(parents=True)
    (tutel / "setup.py").write_text("# setup")
    folder = tmp_path / "carry"
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_carry.sh"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "true"}
    argv = ["bash", str(script), str(tutel), str(folder)]
    assert subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode == 0
    assert (folder / ".made-by-gpu-carry").is_file() and (folder / "tutel" / "setup.py").is_file()
    (folder / "notes.txt").write_text("a user's file")
    (folder / "tutel" / "stale.txt").write_text("from an earlier run")
    assert subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode == 0
    assert (folder / "notes.txt").read_text() == "a user's file"
    assert not (folder / "tutel" / "stale.txt").exists() and (folder / "wheels").is_dir()


def test_a_skipped_stage_is_named_and_exits_1_unless_allowed(tmp_path, monkeypatch, capsys):
    """Issue 49 item 11: stages skipped for the budget make the check incomplete: named on
    stderr, exit 1; --allow-skips (Check(allow_skips=True)) accepts them, still naming them."""
    ok = lambda check, limit: ("passed", "")  # noqa: E731
    _fake_stages(monkeypatch, {k: ok for k in "abcdf"})
    assert gpu_check.Check(tmp_path, 155, rehearse=False, carry=tmp_path).main() == 1
    err = capsys.readouterr().err
    assert "error: skipped stage(s) c (layer benchmark at four shapes: needs 160 s" in err, err
    assert "--allow-skips" in err
    check = gpu_check.Check(tmp_path, 155, rehearse=False, carry=tmp_path, allow_skips=True)
    assert check.main() == 0
    assert "note: skipped stage(s) c (" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["45", "100", "134", "554"])
def test_a_budget_below_the_stages_sum_is_refused_before_work(tmp_path, capsys, budget):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--budget", budget, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--budget {budget} is less than the 555 s" in err, err
    assert "--allow-skips" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["root", "usr", "home", "repo", "users_report"])
def test_a_dangerous_out_is_refused_and_a_users_report_kept(tmp_path, capsys, monkeypatch, where):
    """--out / (or a system folder, $HOME, the repository) and a folder holding a gpu-check.md
    this check did not write are one error line; nothing there is written or replaced. (The
    test itself writes nowhere outside tmp_path, even against a check that would.)"""
    real_write = Path.write_text

    def guarded(self, *a, **k):
        assert str(self).startswith(str(tmp_path)), f"wrote {self}"
        return real_write(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", guarded)
    monkeypatch.setattr(gpu_check, "Check", None)  # no stage ever starts here
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "gpu-check.md").write_text("a user's notes")
    out = {"root": "/", "usr": "/usr/lib", "home": str(Path.home()),
           "repo": str(gpu_check.ROOT), "users_report": str(mine)}[where]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", out, "--budget", "560"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: --out {out}: " in err and "Traceback" not in err
    assert (mine / "gpu-check.md").read_text() == "a user's notes"
    assert not os.path.lexists(Path(out) / ".made-by-gpu-check") or where == "repo"


def test_the_checks_own_report_folder_is_reused(tmp_path):
    assert gpu_check.report_folder_problem(tmp_path / "out") is None
    (tmp_path / "out" / "gpu-check.md").write_text("# GPU check")  # its own, from a run
    assert gpu_check.report_folder_problem(tmp_path / "out") is None
    assert [p.name for p in (tmp_path / "out").iterdir() if "probe" in p.name] == []


def test_gpu_carry_refuses_a_folder_holding_the_tutel_source(tmp_path):
    """Issue 49 item 11: `gpu_carry.sh .gpu-carry/tutel .gpu-carry` deleted its own source
    (the rm -rf of FOLDER/tutel); a FOLDER holding the checkout is refused, the source kept."""
    folder = tmp_path / "carry"
    tutel = folder / "tutel"  # an earlier run's snapshot, used as the source
    (tutel / "tutel").mkdir(parents=True)
    (tutel / "setup.py").write_text("# setup")
    (folder / ".made-by-gpu-carry").write_text("")
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_carry.sh"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "false"}  # no download either way
    run = subprocess.run(["bash", str(script), str(tutel), str(folder)], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "is inside" in run.stderr and "copy the checkout" in run.stderr
    assert (tutel / "setup.py").read_text() == "# setup" and (tutel / "tutel").is_dir()
