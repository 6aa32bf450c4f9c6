#!/usr/bin/env bash
# Set up and run the main job on a fresh machine: the M6-style multimodal example, tiny config,
# single process on CPU. Extra arguments go to examples/m6/train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build of torch first: any other torch request may pull a multi-GB CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[examples]"
python3 examples/m6/train.py "$@"
