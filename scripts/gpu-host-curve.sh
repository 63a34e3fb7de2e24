#!/usr/bin/env bash
# The end-to-end curve at sizes this development VM cannot hold (issue 27,
# item 5), on a lent host with memory to spare: the GPU host has 128 GB of
# RAM and 64 GB of disk, and no network. `bench_e2e.py --lean` (publisher
# daemon + one subscriber daemon over a file:// bucket, the baselines of
# the same run) with the checkpoint, the publisher's state and the bucket
# in /dev/shm and the subscriber's slots on the disk.
#
#   cargo build --release                       # here: the binary travels
#   pip download --only-binary=:all: --python-version 3.12 -d .whl-deps numpy
#   # on the host (device run, carry target/release/weightcast and .whl-deps,
#   # or .gpu-carry as scripts/gpu-host-anchor.sh packs it):
#   OUT=$OUT SIZES=4e9,8e9 bash scripts/gpu-host-curve.sh
#
# Two leases (2026-11-27) ran out of time at 8e9 after the anchor: drawing
# the model and each step's changes with numpy took most of 245-400 s, and
# the subscriber's slots on the host's disk wrote 32 GB. So the model is
# drawn with --fast-gen (3x faster to write, 40x faster to step), and
# DISK=/dev/shm/... keeps the slots in memory where the host has it.
#
# Writes $OUT/e2e.json (bench_e2e's JSON), $OUT/e2e.txt (its log) and
# $OUT/steps.txt. Every step is bounded (CURVE_TIMEOUT seconds in all).
set -u
OUT=${OUT:-/tmp/curve-out}
PY=${PYTHON:-python3}
LIB=${WEIGHTCAST_GPU_LIB:-/tmp/wc-curve-lib}
SHM=${SHM:-/dev/shm/wc-e2e}
DISK=${DISK:-/tmp/wc-e2e-out}
mkdir -p "$OUT" "$LIB"
cd "$(dirname "$0")/.."
shopt -s nullglob
np=(.whl-deps/numpy-*.whl .gpu-carry/wheels/numpy-*.whl)
"$PY" -c 'import numpy' 2>/dev/null || "$PY" -m pip install --quiet --no-deps --no-index \
    --target "$LIB" "${np[@]:0:1}" > "$OUT/steps.txt" 2>&1
export PYTHONPATH=$LIB
# The binary may travel xz-compressed, as scripts/gpu-host-anchor.sh's does.
if [ ! -x target/release/weightcast ] && [ -f .gpu-carry/weightcast.xz ]; then
    mkdir -p target/release
    "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        .gpu-carry/weightcast.xz target/release/weightcast && chmod +x target/release/weightcast
fi
{ date +%s; nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2; } >> "$OUT/steps.txt" 2>&1
[ -x target/release/weightcast ] || { echo "target/release/weightcast is missing: carry it" >> "$OUT/steps.txt"; exit 1; }
rm -rf "$SHM" "$DISK"
timeout "${CURVE_TIMEOUT:-540}" "$PY" scripts/bench_e2e.py --sizes "${SIZES:-4e9,8e9}" --lean \
    --versions "${VERSIONS:-3}" --density "${DENSITY:-0.015}" --work "$SHM" --out-root "$DISK" --fast-gen \
    --json "$OUT/e2e.json" > "$OUT/e2e.txt" 2>&1
echo "rc=$? $(date +%s)" >> "$OUT/steps.txt"
rm -rf "$SHM" "$DISK"
