#!/usr/bin/env bash
# Set up and run the main job on a fresh machine: the M6-style multimodal example, tiny config,
# single process on CPU. Extra arguments go to examples/m6/train.py.
#
# Installs into a virtual environment, never into the system's Python (PEP 668): the active
# one ($VIRTUAL_ENV), else ./.venv, created here on the first run (`python3 -m venv`; on
# Debian/Ubuntu that needs the python3-venv package).
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
if [ -n "${VIRTUAL_ENV:-}" ]; then
  py="$VIRTUAL_ENV/bin/python"
else
  if [ ! -x .venv/bin/python ]; then
    echo "quickstart: creating a virtual environment in .venv" >&2
    if ! python3 -m venv .venv; then
      echo "error: python3 -m venv failed: install python3-venv (Debian/Ubuntu) or activate" \
        "a virtual environment first" >&2
      exit 1
    fi
  fi
  py=.venv/bin/python
fi
# The CPU build of torch first: a plain `pip install torch` from PyPI pulls the CUDA build
# (several GB). PyTorch's CPU index has the CPU build; a pip configured with its own index or
# wheel folder (a mirror, an offline machine) is used as configured.
if ! "$py" -c "import torch" 2>/dev/null; then
  if env | grep -qE '^PIP_(INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS)=' \
    || "$py" -m pip config list 2>/dev/null | grep -qE 'index-url|find-links'; then
    "$py" -m pip install -q torch==2.13.0
  else
    "$py" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$py" -m pip install -q -e ".[examples]"
"$py" examples/m6/train.py "$@"
