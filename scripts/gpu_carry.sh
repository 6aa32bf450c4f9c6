#!/usr/bin/env bash
# Fill .gpu-carry/ (git-ignored) with the peers an offline GPU machine lacks, for the GPU check:
#   scripts/gpu_carry.sh PATH/TO/TUTEL [FOLDER]      # FOLDER defaults to .gpu-carry
# - wheels/: a DeepSpeed wheel built with DS_BUILD_OPS=0 (no CUDA ops compiled: pure Python) and
#   the wheels of what `import deepspeed.moe.layer` needs that a torch machine may lack, for
#   CPython 3.12 manylinux (the GPU machine's Python), from the package index;
# - tutel/: a source snapshot of the local Tutel checkout PATH/TO/TUTEL (Tutel is not on the
#   package index; its CUDA extension is built on the GPU machine, in the background).
# Under 40 MiB in all (checked). FOLDER must be missing, empty, or made by this script (it holds
# .made-by-gpu-carry); the script replaces only its own wheels/ and tutel/ there, never a
# folder it did not make, and refuses a FOLDER that holds (or is inside) the Tutel checkout.
# On the GPU machine scripts/gpu_check.sh installs them:
#   pip install --no-index --no-deps --target DIR FOLDER/wheels/*.whl   (seconds)
#   pip install --no-build-isolation --no-deps --target DIR FOLDER/tutel (about 70 s)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ ! -f "$1/setup.py" ] || [ ! -d "$1/tutel" ]; then
    echo "usage: $0 PATH/TO/TUTEL [FOLDER]: a Tutel source checkout (setup.py, tutel/)" >&2
    exit 2
fi
TUTEL=$1
DEST=${2:-.gpu-carry}
PY=${PYTHON:-python3}
LIMIT_MIB=40
# DeepSpeed's runtime dependencies (its requirements) that `import deepspeed.moe.layer` reaches,
# torch, numpy and packaging excepted (the GPU machine has them).
DEPS="hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions
py-cpuinfo msgpack psutil ninja einops tqdm"
MARK=.made-by-gpu-carry
if [ -e "$DEST" ] && [ ! -d "$DEST" ]; then
    echo "error: $DEST is not a folder: refusing to write there" >&2
    exit 2
fi
if [ -d "$DEST" ] && [ ! -f "$DEST/$MARK" ] && [ -n "$(ls -A "$DEST")" ]; then
    echo "error: $DEST is not empty and was not made by $0: refusing to write there" >&2
    exit 2
fi
case "$(realpath -m "$DEST")/" in
"$(realpath "$TUTEL")"/*)
    echo "error: $DEST is inside the Tutel checkout $TUTEL (or is it): refusing to write there" >&2
    exit 2
    ;;
esac
case "$(realpath "$TUTEL")/" in
"$(realpath -m "$DEST")"/*)  # e.g. .gpu-carry/tutel: the rm -rf below would delete the source
    echo "error: the Tutel checkout $TUTEL is inside $DEST, whose tutel/ and wheels/ this" \
        "script replaces: copy the checkout elsewhere first, or pass another FOLDER" >&2
    exit 2
    ;;
esac
mkdir -p "$DEST"
touch "$DEST/$MARK"
rm -rf "${DEST:?}/wheels" "${DEST:?}/tutel"  # this script's own, from an earlier run
mkdir -p "$DEST/wheels"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps deepspeed -w "$DEST/wheels"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --implementation cp \
    -d "$DEST/wheels" $DEPS
mkdir -p "$DEST/tutel"
if git -C "$TUTEL" rev-parse --git-dir >/dev/null 2>&1; then  # a checkout: its committed files
    git -C "$TUTEL" archive HEAD | tar -x -C "$DEST/tutel"
    git -C "$TUTEL" rev-parse HEAD >"$DEST/tutel/COMMIT"
else
    cp -R "$TUTEL"/. "$DEST/tutel/"
    rm -rf "$DEST/tutel/.git"
fi
SIZE_KIB=$(du -sk "$DEST" | cut -f1)
ls -1 "$DEST/wheels"
echo "$DEST: $((SIZE_KIB / 1024)) MiB ($SIZE_KIB KiB)"
if [ "$SIZE_KIB" -gt $((LIMIT_MIB * 1024)) ]; then
    echo "error: $DEST is over $LIMIT_MIB MiB: the working tree travels with it (64 MiB in all)" >&2
    exit 1
fi
