#!/usr/bin/env bash
# One command on a fresh CUDA machine that has torch and triton but no network:
#   scripts/gpu_check.sh
# 1. makes the checkout importable without dependencies (pip --no-deps, else PYTHONPATH),
# 2. runs the test suite on CUDA (kernel configs pinned by tests/conftest.py),
# 3. trains the M6 example: m6-tiny and the GPU preset m6-tiny-gpu (needs scikit-learn),
# 4. runs bench/gpu_layer.py when the repository has it,
# and writes a dated markdown report to bench/results/ (to $OUT instead when it is set).
# A missing optional package (transformers, deepspeed, scikit-learn, ...) is named and its
# stage skipped; the script's exit status is 1 when a stage that ran failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DAY=$(date -u +%Y-%m-%d)
REPORT_DIR=${OUT:-$ROOT/bench/results}
REPORT=$REPORT_DIR/$DAY-gpu-check.md
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moe-gpu-check.XXXXXX")
mkdir -p "$REPORT_DIR"
FAILED=0

note() { printf '%s\n' "$*" | tee -a "$REPORT"; }

# stage NAME TIMEOUT_S CMD...: run CMD, log its output, add its status, time and tail to the report.
stage() {
    local name=$1 limit=$2
    shift 2
    local log="$WORK/$(echo "$name" | tr ' /' '__').log" start=$SECONDS rc
    echo "== $name: $*"
    timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && FAILED=1
    note ""
    note "## $name"
    note "\`$*\`: exit $rc in $((SECONDS - start)) s"
    note ""
    note '```'
    tail -n "${TAIL:-25}" "$log" | tee -a "$REPORT"
    note '```'
}

has() { "$PY" -c "import $1" >/dev/null 2>&1; }

: >"$REPORT"
note "# GPU check, $DAY"
note ""
"$PY" - <<'EOF' | tee -a "$REPORT"
import platform, torch
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "not installed"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CUDA unavailable)"
print(f"- host {platform.node()}, Python {platform.python_version()}")
print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}")
print(f"- GPU: {gpu}, {torch.cuda.device_count()} device(s)")
EOF
if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    note "error: CUDA is not available to torch: nothing to check on a GPU"
    exit 1
fi

# 1. the project, without its dependencies (no network)
if "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/pip.log" 2>&1; then
    note "- installed: pip install --no-deps --no-build-isolation -e ."
else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    note "- pip install failed ($(tail -n 1 "$WORK/pip.log")); using PYTHONPATH=$ROOT"
fi
for pkg in pytest sklearn matplotlib transformers safetensors deepspeed; do
    has "$pkg" || note "- optional package not importable: $pkg (its tests or stages are skipped)"
done

# 2. the test suite on CUDA (tests/conftest.py pins one Triton config: no autotuning)
if has pytest; then
    TAIL=40 stage "test suite" 1800 "$PY" -m pytest -q -ra -p no:cacheprovider --durations=15 tests
else
    note "" && note "## test suite" && note "skipped: pytest is not importable"
fi

# 3. the M6 example on the GPU: the CPU preset and the GPU preset, side by side
if has sklearn; then
    for config in m6-tiny m6-tiny-gpu; do
        TAIL=16 stage "M6 $config" 1800 "$PY" examples/m6/train.py --config "$config" \
            --device cuda --no-plots --run-dir "$WORK/$config"
    done
else
    note "" && note "## M6" && note "skipped: scikit-learn (the digits data) is not importable"
fi

# 4. the layer benchmark, when the repository has one
if [ -f bench/gpu_layer.py ]; then
    TAIL=40 stage "bench/gpu_layer.py" 1800 "$PY" -m bench.gpu_layer
else
    note "" && note "## bench/gpu_layer.py" && note "skipped: bench/gpu_layer.py is not in this checkout"
fi

note ""
note "Overall: $([ "$FAILED" -eq 0 ] && echo "every stage that ran passed" || echo "a stage FAILED")"
echo "report: $REPORT (logs in $WORK)"
exit "$FAILED"
