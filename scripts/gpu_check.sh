#!/usr/bin/env bash
# The GPU check of issue 35: one command on a fresh, offline CUDA machine, inside a time budget.
#   scripts/gpu_check.sh [--budget SECONDS] [--out DIR]   # default budget 560 s; DIR default $OUT
#   scripts/gpu_check.sh --rehearse [--out DIR]           # the same plumbing on CPU (CI runs it)
# Stages (bench/gpu_check.py): a. environment, carried peers (scripts/gpu_carry.sh), AOT check;
# b. CUDA correctness with pinned kernel configs (pointer, TMA); c. bench.gpu_layer at the four
# shapes; d. the M6 GPU preset for 45 s; f. FP8 CUDA tests and FP8 vs bf16 grouped GEMMs and
# layers (rowwise, blockwise, with and without FP8 dispatch) at the four shapes, each layer
# beside bench.budget's floor (bench/gpu_fp8.py); e. decisions. Writes DIR/gpu-check.md, gpu-check.json,
# gpu-check-log.txt, gpu-layer.md, even when a stage fails or the budget ends.
# Exit status 1 when a stage failed or was skipped (--allow-skips accepts skips, and a --budget
# below the stages' 555 s), or (rehearsal) a check failed. --out refuses /, system folders,
# $HOME, the repository and a folder with a gpu-check.md this check did not write.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "${PYTHON:-python3}" -m bench.gpu_check "$@"
