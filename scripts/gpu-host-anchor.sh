#!/usr/bin/env bash
# Anchors on a many-core host (issue 27, item 4): `bench_anchor.py` with
# Garage on loopback (no link: how many GB/s per core the anchor's
# compression and decode reach when the cores are not shared with a slow
# link), then, where the host allows network namespaces and tc, behind the
# emulated 100 MB/s link (the share of the link, with cores to spare; on the
# 2-core development VM the server and the client share two cores).
#
# The lent GPU host has 16 cores and no network, so everything travels,
# compressed (the device tool carries 64 MiB):
#
#   strip -o /tmp/g "$(command -v garage)" && xz -6 -c /tmp/g > .gpu-carry/garage.xz
#   strip -o /tmp/w target/release/weightcast && xz -6 -c /tmp/w > .gpu-carry/weightcast.xz
#   pip download --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .gpu-carry/wheels boto3 numpy
#   # on the host (device run, carry .gpu-carry):
#   OUT=$OUT bash scripts/gpu-host-anchor.sh
#
# Writes $OUT/anchor-loopback.json, $OUT/anchor-link.json (each with a .txt
# log) and $OUT/steps.txt. Every step is bounded (ANCHOR_TIMEOUT seconds
# each); LINK=0 skips the shaped run, RUNS names the runs to make (default
# "loopback link").
set -u
OUT=${OUT:-/tmp/anchor-out}
PY=${PYTHON:-python3}
LIB=${WEIGHTCAST_GPU_LIB:-/tmp/wc-anchor-lib}
BIN=${BIN_DIR:-/tmp/wc-anchor-bin}
mkdir -p "$OUT" "$LIB" "$BIN"
cd "$(dirname "$0")/.."
step() { echo "$(date +%s) $*" >> "$OUT/steps.txt"; }
step start
{ nproc; free -g | head -2; } >> "$OUT/steps.txt" 2>&1
shopt -s nullglob
"$PY" -m pip install --quiet --no-deps --no-index --target "$LIB" .gpu-carry/wheels/*.whl \
    >> "$OUT/steps.txt" 2>&1
export PYTHONPATH=$LIB
for x in garage weightcast; do
    if [ -f ".gpu-carry/$x.xz" ]; then
        # Python's lzma: the image may lack the xz command.
        "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
            ".gpu-carry/$x.xz" "$BIN/$x" && chmod +x "$BIN/$x"
    fi
done
[ -x "$BIN/weightcast" ] || cp target/release/weightcast "$BIN/weightcast" 2>/dev/null
for x in garage weightcast; do
    [ -x "$BIN/$x" ] || { echo "$x is missing: carry .gpu-carry/$x.xz" >> "$OUT/steps.txt"; exit 1; }
done
export GARAGE=$BIN/garage

run() {  # name, link MB/s
    step "$1"
    timeout "${ANCHOR_TIMEOUT:-240}" "$PY" scripts/bench_anchor.py --server garage \
        --link-mbps "$2" --elements "${ELEMENTS:-1e9}" --reps "${REPS:-2}" \
        --work /dev/shm/wcanchor --bin "$BIN/weightcast" --json "$OUT/anchor-$1.json" \
        > "$OUT/anchor-$1.txt" 2>&1
    echo "rc=$?" >> "$OUT/anchor-$1.txt"
    rm -rf /dev/shm/wcanchor
}
case " ${RUNS:-loopback link} " in *" loopback "*) run loopback 0 ;; esac
case " ${RUNS:-loopback link} " in *" link "*)
    if [ "${LINK:-100}" != 0 ] && ip netns add wc-probe 2>/dev/null; then
        ip netns del wc-probe
        run link "${LINK:-100}"
    else
        step "no network namespaces here (or LINK=0): the shaped run is skipped"
    fi ;;
esac
step end
