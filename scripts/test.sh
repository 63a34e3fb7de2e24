#!/usr/bin/env bash
# The whole test suite, as the README's second command and CI run it.
# Installs and starts whatever it needs; works on a fresh machine with the Rust
# toolchain. Environment: FUZZ_SECONDS (per fuzz target, default 20; 0 skips).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s ==\n' "$*"; }

# Real object-store servers the integration tests start on loopback, in a
# virtual environment of the project's own (.ci-work/, git-ignored).
step "test servers (moto)"
venv=.ci-work/venv
if [ ! -x "$venv/bin/moto_server" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'moto[server]==5.*'
fi
export MOTO_SERVER="$PWD/$venv/bin/moto_server"
"$MOTO_SERVER" --help >/dev/null

step "format"
cargo fmt --all -- --check

step "clippy"
cargo clippy --all-targets -- -D warnings

step "unit, integration and doc tests"
cargo test --all-targets
cargo test --doc

step "demo (the README's first command)"
cargo run --release --quiet -- demo --steps 6 --anchor-every 4

if [ "${FUZZ_SECONDS:-20}" != "0" ] && [ -x fuzz/run.sh ]; then
  step "fuzz smoke: every decoder target for ${FUZZ_SECONDS:-20}s"
  fuzz/run.sh "${FUZZ_SECONDS:-20}"
fi

step "all tests passed"
