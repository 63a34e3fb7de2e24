#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and torch (CUDA) but
# possibly no network: the package's torch tests with the engine's tensors on
# the GPU, the pause benchmark on the GPU at 1e9 and 4e9 parameters, and the
# tensor-parallel benchmark with every rank's tensors on the GPU.
#
#   (cd python && maturin build --release -o ../.whl)   # where the build works
#   pip download --only-binary=:all: --python-version 3.12 -d .whl-deps pytest safetensors numpy
#   OUT=/tmp/gpu-out bash scripts/gpu-check.sh           # on the GPU machine
#
# Writes into $OUT: gpu.txt, tests.txt, pause-<params>.json, tp-<world>.json
# (+ .err). SKIP_TESTS=1, PARAMS="..." and TP_WORLD="..." (empty: none) pick.
# The device tool brings back at most 8 files per call: pick few steps, or
# fold the .err files before the call ends.
# Every step is bounded (timeout) and the next runs whatever the last did.
set -u
OUT=${OUT:-/tmp/gpu-out}
PY=${PYTHON:-python3}
LIB=${WEIGHTCAST_GPU_LIB:-/tmp/wc-gpu-lib}
SCRATCH=${SCRATCH:-/tmp}
mkdir -p "$OUT" "$LIB"
cd "$(dirname "$0")/.."

# The test dependencies travel as wheels where the image lacks them.
shopt -s nullglob
deps=()
"$PY" -c 'import pytest, safetensors' 2>/dev/null || deps+=(.whl-deps/pytest-*.whl
    .whl-deps/pluggy-*.whl .whl-deps/iniconfig-*.whl .whl-deps/packaging-*.whl
    .whl-deps/pygments-*.whl .whl-deps/safetensors-*.whl)
"$PY" -c 'import numpy' 2>/dev/null || deps+=(.whl-deps/numpy-*.whl)
"$PY" -m pip install --quiet --no-deps --no-index --target "$LIB" .whl/weightcast-*.whl "${deps[@]}" \
    > "$OUT/install.txt" 2>&1
export PYTHONPATH=$LIB HF_HUB_OFFLINE=1
stamp() { echo "$(date +%s) $*" >> "$OUT/steps.txt"; }
stamp start
{ nvidia-smi -L; "$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'; nproc
  free -g | head -2; } > "$OUT/gpu.txt" 2>&1

stamp tests
[ -n "${SKIP_TESTS:-}" ] || WEIGHTCAST_TEST_DEVICES=cpu,cuda timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -q \
    python/tests/test_torch.py -k "${TEST_K:-training_steps or device_and_publishes}" > "$OUT/tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/tests.txt"

for world in ${TP_WORLD-2}; do
    stamp "tp $world"
    timeout "${TP_TIMEOUT:-120}" "$PY" examples/python/bench_tp.py --world "$world" --device cuda \
        --params "${TP_PARAMS:-5e8}" --versions 3 > "$OUT/tp-$world.json" 2> "$OUT/tp-$world.err"
    echo "rc=$?" >> "$OUT/tp-$world.err"
done

for params in ${PARAMS-1e9 4e9}; do
    stamp "pause $params"
    timeout "${BENCH_TIMEOUT:-240}" "$PY" examples/python/bench_pause.py --params "$params" \
        --device cuda --repeats 3 --dir "$SCRATCH" \
        > "$OUT/pause-$params.json" 2> "$OUT/pause-$params.err"
    echo "rc=$?" >> "$OUT/pause-$params.err"
done
stamp end
