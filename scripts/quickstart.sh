#!/usr/bin/env bash
# Set up and run the main job on a fresh machine: the M6-style multimodal example, tiny config,
# single process on CPU. Extra arguments go to examples/m6/train.py.
#
# Installs into a virtual environment, never into the system's Python (PEP 668): the active
# one ($VIRTUAL_ENV), else ./.venv, created here on the first run (`python3 -m venv`; on
# Debian/Ubuntu that needs the python3-venv package). Afterwards `. .venv/bin/activate` makes
# `python` and `pip` the environment's for the README's next commands.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
say() { echo "quickstart: $*" >&2; }
if [ -n "${VIRTUAL_ENV:-}" ]; then
  py="$VIRTUAL_ENV/bin/python"
  say "using the active virtual environment $VIRTUAL_ENV"
else
  if [ ! -x .venv/bin/python ]; then
    say "creating a virtual environment in .venv (python3 -m venv .venv)"
    if ! python3 -m venv .venv; then
      say "error: python3 -m venv failed: install python3-venv (Debian/Ubuntu) or activate" \
        "a virtual environment first"
      exit 1
    fi
  fi
  py=.venv/bin/python
  say "using the virtual environment .venv"
fi
# An index that cannot be reached fails in seconds, not after minutes of retries.
pip_net=(--retries 1 --timeout 15)
# The CPU build of torch first: a plain `pip install torch` from PyPI pulls the CUDA build
# (several GB). PyTorch's CPU index has the CPU build (https://download.pytorch.org/whl/cpu, as
# pytorch.org documents it); a pip configured with its own index or wheel folder (a mirror, an
# offline machine) is used as configured.
if "$py" -c "import torch" 2>/dev/null; then
  say "torch is installed: $("$py" -c 'import torch; print(torch.__version__)')"
elif env | grep -qE '^PIP_(INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS)=' \
  || "$py" -m pip config list 2>/dev/null | grep -qE 'index-url|find-links'; then
  say "installing torch==2.13.0 from pip's configured index (a download of ~200 MB)"
  "$py" -m pip install "${pip_net[@]}" torch==2.13.0
else
  say "installing torch==2.13.0 (CPU build) from https://download.pytorch.org/whl/cpu (~200 MB)"
  "$py" -m pip install "${pip_net[@]}" torch==2.13.0 \
    --index-url https://download.pytorch.org/whl/cpu
fi
say "installing moe with its [examples] extra (scikit-learn, matplotlib, tqdm)"
"$py" -m pip install -q "${pip_net[@]}" -e ".[examples]"
say "training the M6 example (tiny config, CPU, about a minute)"
"$py" examples/m6/train.py "$@"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  say "done; for the README's next commands: . .venv/bin/activate"
fi
