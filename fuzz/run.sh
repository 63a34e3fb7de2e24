#!/usr/bin/env bash
# Bounded fuzzing run over every target, for CI and for a quick local check.
#
#   fuzz/run.sh [seconds-per-target]      (default 30)
#   fuzz/run.sh --build-only              install cargo-fuzz if missing and build
#                                         every target, nothing else (scripts/test.sh
#                                         runs it early, at low priority, in the
#                                         background: the build fills the cores the
#                                         other steps leave idle)
#
# Installs cargo-fuzz if it is missing, regenerates the seed corpus
# (examples/fuzz_seeds.rs), builds every target, then fuzzes each one for the
# given number of seconds, replaying fuzz/regressions/<target>/ first. Exits
# non-zero if any target finds a crash (panic, failed invariant, sanitizer
# report, timeout or out-of-memory); the input is left in
# fuzz/artifacts/<target>/ and each target's log in fuzz/artifacts/logs/.
#
# Environment:
#   FUZZ_SANITIZER   address (default) or none
#   FUZZ_TIMEOUT     seconds one input may take before it counts as a hang (default 20)
#   FUZZ_JOBS        targets fuzzed at once (default: the number of cores)
#
# The stable toolchain works: RUSTC_BOOTSTRAP=1 lets it accept the -Z flags
# cargo-fuzz passes (-Zsanitizer=address among them).
set -euo pipefail

build_only=0
if [ "${1:-}" = --build-only ]; then
    build_only=1
    set -- 0
fi
secs="${1:-30}"
case "$secs" in '' | *[!0-9]*)
    echo "usage: $0 [seconds-per-target]" >&2
    exit 2
    ;;
esac
sanitizer="${FUZZ_SANITIZER:-address}"
timeout="${FUZZ_TIMEOUT:-20}"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

if [ "$build_only" = 1 ]; then
    echo "== build (sanitizer: $sanitizer)"
    exec cargo fuzz build --sanitizer "$sanitizer"
fi

echo "== seed corpus"
# The debug build with the fault-injection points is the one the test suite
# (scripts/test.sh) has already made: no rebuild (the seeds are small, and
# they use none of the points, which act only when WEIGHTCAST_FAILPOINT is set).
# Without RUSTC_BOOTSTRAP: build scripts that read it (proc-macro2, anyhow,
# thiserror) would otherwise rebuild the whole debug tree (two minutes in CI).
env -u RUSTC_BOOTSTRAP cargo run --quiet --features failpoints --example fuzz_seeds

echo "== build (sanitizer: $sanitizer; nothing to do after --build-only)"
cargo fuzz build --sanitizer "$sanitizer"

mkdir -p fuzz/artifacts/logs
# One target per core at a time (FUZZ_JOBS overrides): libFuzzer runs one
# process per target, so on 2 cores two targets take the wall time of one.
jobs="${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}"
case "$jobs" in '' | *[!0-9]* | 0) jobs=1 ;; esac

fuzz_one() { # target -> exit status; its log in fuzz/artifacts/logs/<target>.log
    local t="$1" dirs dict
    dirs=("fuzz/corpus/$t")
    if [ -d "fuzz/regressions/$t" ]; then
        dirs+=("fuzz/regressions/$t")
    fi
    dict=()
    if [ "$t" != compact_block ]; then
        dict=(-dict=fuzz/weightcast.dict)
    fi
    cargo fuzz run --sanitizer "$sanitizer" "$t" "${dirs[@]}" -- \
        -max_total_time="$secs" -timeout="$timeout" "${dict[@]}" -print_final_stats=1 \
        >"fuzz/artifacts/logs/$t.log" 2>&1
}

report() { # target status seconds
    local t="$1" status="$2" took="$3" log="fuzz/artifacts/logs/$1.log" runs
    if [ "$status" = 0 ]; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
        echo "== $t: ok, ${runs:-?} executions in ${took}s"
    else
        echo "== $t: FAILED (log: $log)"
        grep -E "panicked|ERROR:|SUMMARY:|Test unit written" "$log" | head -n 8 | sed 's/^/   /' || true
        failed+=("$t")
    fi
}

echo "== fuzzing each target for ${secs}s, $jobs at a time"
failed=()
targets=($(cargo fuzz list))
i=0
while [ "$i" -lt "${#targets[@]}" ]; do
    batch=("${targets[@]:i:jobs}")
    pids=()
    start=$(date +%s)
    for t in "${batch[@]}"; do
        fuzz_one "$t" &
        pids+=($!)
    done
    for k in "${!batch[@]}"; do
        status=0
        wait "${pids[$k]}" || status=$?
        report "${batch[$k]}" "$status" "$(($(date +%s) - start))"
    done
    i=$((i + jobs))
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "== crashes in: ${failed[*]}"
    echo "   reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run <target> fuzz/artifacts/<target>/<file>"
    exit 1
fi
echo "== no crashes"
