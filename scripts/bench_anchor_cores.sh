#!/usr/bin/env bash
# Anchors against the number of cores (issue 27, item 4): `weightcast
# publish` of a fresh checkpoint (a compressed `planes` anchor) and a fresh
# `weightcast subscribe --once`, each pinned with `taskset` to 1, 2, ... cores,
# into a `file://` bucket on tmpfs: no server and no link, so the command's
# own CPU (compression, digests, decode, the kernel's copies) is all there is
# to measure. Prints one JSON line per command and core count (wall, user
# and system seconds; GB/s of model per wall second and per CPU second).
#
#   scripts/bench_anchor_cores.sh                       # 1 and 2 cores, 1e9 elements, 3 reps
#   CORES="0 0-1 0-3 0-7 0-15" REPS=2 scripts/bench_anchor_cores.sh   # a 16-core host
#
# Then, with CODEC_THREADS (default "1 2"; empty: skipped), the codec alone:
# `weightcast bench anchors --threads N` on the generator (CODEC_ELEMENTS,
# default 1e8), in memory, with its CPU-based GB/s per thread; its JSON
# rows go to $OUT_DIR (default: not kept).
#
# Needs numpy (for the model, as scripts/bench_e2e.py writes it) and a
# release build. Uses $WORK (default /dev/shm/wcanchor-cores: about 5x the
# model's bytes) and removes it at the end. Every command is bounded by
# $TIMEOUT seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BIN=${BIN:-target/release/weightcast}
WORK=${WORK:-/dev/shm/wcanchor-cores}
ELEMENTS=${ELEMENTS:-1e9}
SHARDS=${SHARDS:-4}
REPS=${REPS:-3}
CORES=${CORES:-0 0-1}
CODEC_THREADS=${CODEC_THREADS-1 2}
CODEC_ELEMENTS=${CODEC_ELEMENTS:-1e8}
OUT_DIR=${OUT_DIR:-}
TIMEOUT=${TIMEOUT:-300}
[ -x "$BIN" ] || { echo "no $BIN: run cargo build --release first" >&2; exit 1; }
rm -rf "$WORK"
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT
"$PY" - "$WORK/model" "$ELEMENTS" "$SHARDS" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
from bench_e2e import write_model
write_model(Path(sys.argv[1]), int(float(sys.argv[2])), int(sys.argv[3]), 7)
PY
model_bytes=$(( $(du -sb "$WORK/model" | cut -f1) ))
timed() {  # cores, output file, command...
    local cores=$1 out=$2
    shift 2
    { timeout "$TIMEOUT" taskset -c "$cores" /usr/bin/time -f "%e %U %S" "$@" > "$out"; } 2>&1 | tail -1
}
for rep in $(seq "$REPS"); do
    for cores in $CORES; do
        rm -rf "$WORK/bucket" "$WORK/state" "$WORK/out"
        mkdir -p "$WORK/bucket"
        p=$(timed "$cores" "$WORK/pub.json" "$BIN" publish --checkpoint "$WORK/model" \
            --store "file://$WORK/bucket" --state "$WORK/state")
        s=$(timed "$cores" "$WORK/sub.json" "$BIN" subscribe --once \
            --store "file://$WORK/bucket" --out "$WORK/out")
        "$PY" - "$rep" "$cores" "$model_bytes" "$p" "$s" "$WORK" <<'PY'
import json, os, sys
rep, cores, model, p, s, work = sys.argv[1:]
model = int(model)
n = len(os.sched_getaffinity(0)) if cores == "all" else sum(
    (int(b) - int(a) + 1) if "-" in c else 1
    for c in cores.split(",") for a, _, b in [c.partition("-")])
pub = json.load(open(f"{work}/pub.json"))
sub = json.load(open(f"{work}/sub.json"))
def row(times, **extra):
    wall, user, sys_ = map(float, times.split())
    return {"wall_s": wall, "user_s": user, "sys_s": sys_,
            "gb_per_s": round(model / wall / 1e9, 3),
            "gb_per_cpu_s": round(model / (user + sys_) / 1e9, 3), **extra}
visible = sum(sub.get(k) or 0 for k in ("fetch_s", "prepare_s", "pause_s", "apply_s"))
print(json.dumps({"rep": int(rep), "cores": n, "cpus": cores, "model_bytes": model,
                  "anchor_bytes": pub["bytes"], "publish": row(p),
                  "bootstrap": row(s, visible_s=round(visible, 3))}), flush=True)
PY
    done
done
for n in $CODEC_THREADS; do
    json=${OUT_DIR:+$OUT_DIR/anchor-codec-threads-$n.json}
    timeout "$TIMEOUT" "$BIN" bench anchors --elements "$(printf '%.0f' "$CODEC_ELEMENTS")" \
        --threads "$n" --reps 5 ${json:+--json "$json"} 2>&1 | sed "s/^/codec threads=$n: /"
done
