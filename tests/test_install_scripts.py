""".ci/run and scripts/quickstart.sh on a plain laptop (issue 49 item 16), run against a fake
`python3` that records every call: they install into a virtual environment (the active one,
else .venv, made by `python3 -m venv`), take torch's CPU build from PyTorch's CPU index when
pip has no index of its own (and pip as configured when it has), skip torch when 2.13.0 is
there, bound an unreachable index (--retries, --timeout) and say what they do."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in python3: logs "<which python> <args>", then acts out what the scripts ask.
echo "$0 $*" >> "$FAKE_LOG"
case "$*" in
  "-m venv"*)
    dir="${@: -1}"; mkdir -p "$dir/bin"
    cp "$0" "$dir/bin/python"; cp "$0" "$dir/bin/python3"
    printf 'export VIRTUAL_ENV="%s"\nexport PATH="%s/bin:$PATH"\n' "$PWD/$dir" "$PWD/$dir" \
      > "$dir/bin/activate" ;;
  "-m pip config list"*) printf '%s' "$FAKE_PIP_CONFIG" ;;
  "-c import torch") [ -n "$FAKE_TORCH" ]; exit ;;
  "-c "*torch*) [ -n "$FAKE_TORCH" ] && echo "$FAKE_TORCH"; exit ;;
esac
exit 0
"""


def _run(tmp_path, script: str, venv: bool = False, pip_config: str = "", torch: str = "",
         args: tuple[str, ...] = ()):  # fmt: skip
    """Run a copy of `script` in a bare checkout under tmp_path with the fake python3 first on
    PATH; (its log lines with the fake's paths shortened, its stderr)."""
    repo = tmp_path / "repo"
    for path in (".ci/run", "scripts/quickstart.sh"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, repo / path)
    (repo / "scripts/gpu_check.sh").write_text("#!/usr/bin/env bash\nexit 0\n")
    (repo / "scripts/gpu_check.sh").chmod(0o755)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(FAKE_PYTHON)
    (fake / "python3").chmod(0o755)
    log = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(PATH=f"{fake}:{env['PATH']}", FAKE_LOG=str(log), FAKE_PIP_CONFIG=pip_config,
               FAKE_TORCH=torch, PIP_CONFIG_FILE=os.devnull)  # fmt: skip
    if venv:
        active = tmp_path / "active"
        (active / "bin").mkdir(parents=True)
        shutil.copy(fake / "python3", active / "bin" / "python")
        env["VIRTUAL_ENV"] = str(active)
    done = subprocess.run(["bash", script, *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    calls = log.read_text().replace(str(repo) + "/", "").replace(str(tmp_path) + "/", "")
    return calls.splitlines(), done.stderr


def _torch_installs(calls):
    return [c for c in calls if " -m pip install" in c and "torch==2.13.0" in c and " -e " not in c]


@pytest.mark.parametrize("script", [".ci/run", "scripts/quickstart.sh"])
def test_a_laptop_gets_a_venv_and_the_cpu_build(tmp_path, script):
    calls, said = _run(tmp_path, script)
    venv = [c for c in calls if " -m venv " in c]
    assert (
        len(venv) == 1 and venv[0].startswith("bin/python3 -m venv") and venv[0].endswith(" .venv")
    ), calls
    after = calls[calls.index(venv[0]) + 1 :]
    assert after and all(c.startswith(".venv/bin/python") for c in after), calls  # all in .venv
    (torch,) = _torch_installs(calls)
    assert CPU_INDEX in torch and "--retries" in torch and "--timeout" in torch, torch
    assert any(" -e ." in c for c in after)  # moe itself, in the environment
    assert "creating a virtual environment in .venv" in said and "torch==2.13.0 (CPU" in said


@pytest.mark.parametrize("script", [".ci/run", "scripts/quickstart.sh"])
def test_a_configured_pip_is_used_as_configured(tmp_path, script):
    calls, _ = _run(tmp_path, script, pip_config="global.find-links='/opt/wheels'\n")
    (torch,) = _torch_installs(calls)
    assert "--index-url" not in torch and "--retries" in torch, torch


@pytest.mark.parametrize("script", [".ci/run", "scripts/quickstart.sh"])
def test_an_active_venv_is_used_and_an_installed_torch_kept(tmp_path, script):
    calls, said = _run(tmp_path, script, venv=True, torch="2.13.0")
    assert not any(" -m venv " in c for c in calls), calls
    assert not _torch_installs(calls), calls
    assert all(c.startswith(("active/bin/python", "bin/python3")) for c in calls), calls
    assert "torch" in said and "installed" in said


def test_the_quick_tier_is_pytest_m_quick_without_the_aot_check(tmp_path):
    """`.ci/run --quick` runs `pytest -m quick` (more arguments passed on); the full run (no
    argument) runs the AOT check first and pytest on everything."""
    quick, _ = _run(tmp_path / "quick", ".ci/run", args=("--quick", "-x"))
    full, _ = _run(tmp_path / "full", ".ci/run", args=("-x",))
    pytest_of = lambda calls: [c.split(" -m pytest ")[1] for c in calls if " -m pytest " in c]
    assert pytest_of(quick) == ["-q -m quick -x"] and pytest_of(full) == ["-q -x"]
    aot = lambda calls: any("tools.triton_aot_check" in c for c in calls)
    assert aot(full) and not aot(quick)
