#!/usr/bin/env bash
# Lints the whole workspace for 64-bit Arm Linux (aarch64-unknown-linux-gnu:
# NVIDIA Grace and other Arm hosts of GPU fleets), as the suite lints x86-64:
# `cargo clippy --all-targets -- -D warnings`, so that code written for
# x86-64 only (the codec's AVX2/AVX-512 kernels and their tests) leaves
# nothing undefined or unused on other CPUs. It compiles, it does not run:
# running needs an Arm machine.
#
# The C sources of two dependencies (zstd; BLAKE3's NEON file) are built by
# their build scripts even for a lint. There is no Arm C compiler here, and a
# lint never links, so the host's gcc stands in, with BLAKE3's NEON file (it
# includes <arm_neon.h>, which only an Arm compiler has) replaced by an empty
# one. Adds the target's standard library with rustup the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
# Without the target's standard library (rustup downloads it once; a
# machine without access to static.rust-lang.org cannot), the lint is
# skipped, visibly, like the container tests without Docker;
# WEIGHTCAST_REQUIRE_AARCH64=1 makes that a failure.
if ! rustup target list --installed | grep -qx "$target"; then
  if ! rustup target add "$target"; then
    if [ "${WEIGHTCAST_REQUIRE_AARCH64:-0}" = 1 ]; then
      echo "check_aarch64: rustup could not add $target (it downloads the target's standard library)" >&2
      exit 1
    fi
    echo "SKIPPED: check_aarch64: rustup could not add $target (it downloads the target's standard library; WEIGHTCAST_REQUIRE_AARCH64=1 makes this a failure)"
    exit 0
  fi
fi
mkdir -p .ci-work
cc="$PWD/.ci-work/aarch64-lint-cc"
cat >"$cc" <<'CC'
#!/usr/bin/env bash
# For lints of aarch64 only (scripts/check_aarch64.sh): objects never linked.
args=()
for a in "$@"; do
  if [[ "$a" == *neon*.c ]]; then
    echo "int weightcast_lint_no_neon;" >"${TMPDIR:-/tmp}/weightcast-lint-neon.c"
    args+=("${TMPDIR:-/tmp}/weightcast-lint-neon.c")
  else
    args+=("$a")
  fi
done
exec gcc "${args[@]}"
CC
chmod +x "$cc"
export CC_aarch64_unknown_linux_gnu="$cc" AR_aarch64_unknown_linux_gnu=ar
# Its own target directory: the host's build is left as it is.
dir=target/lint-aarch64
cargo clippy --target "$target" --target-dir "$dir" --all-targets -- -D warnings
cargo clippy --target "$target" --target-dir "$dir" --all-targets -p weightcast-core -- -D warnings
cargo clippy --target "$target" --target-dir "$dir" -p weightcast-python -- -D warnings
echo "check_aarch64: the workspace lints clean for $target"
