#!/usr/bin/env bash
# Runs every check CI runs: the manual's links and error codes, formatting,
# lints, unit/integration/simulation tests, and the end-to-end suite with real
# processes and the official SDKs.
#
#   scripts/test.sh            everything
#   scripts/test.sh --no-e2e   skip the Python SDK end-to-end suite
#   scripts/test.sh --no-fuzz  skip the fuzz stage (corpus replay + brief runs)
#
# Exits non-zero on the first failing stage.
set -euo pipefail
cd "$(dirname "$0")/.."

run_e2e=1
run_fuzz=1
for arg in "$@"; do
  case "$arg" in
    --no-e2e) run_e2e=0 ;;
    --no-fuzz) run_fuzz=0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

stage() { printf '\n==> %s\n' "$*"; }

# The wire crate compiles its schema with protox: prove no system protoc is
# needed by pointing PROTOC at nothing.
export PROTOC=/nonexistent/protoc
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# A full run builds everything once; incremental caches would roughly double
# the target directory's size and buy nothing here.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# The build needs a few GiB; say so up front rather than dying in a linker.
target_dir="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target_dir"
free_kib=$(df -Pk "$target_dir" | awk 'NR == 2 { print $4 }')
echo "disk: $((free_kib / 1024)) MiB free where $target_dir lives ($(du -sh "$target_dir" | cut -f1) used by it)"
if [ "$free_kib" -lt $((4 * 1024 * 1024)) ]; then
  echo "warning: under 4 GiB free; a clean build may run out of space" >&2
fi
report_disk() { echo "disk: $(du -sh "$target_dir" | cut -f1) in $target_dir, $(($(df -Pk "$target_dir" | awk 'NR == 2 { print $4 }') / 1024)) MiB free"; }

# The manual first: it takes a second and needs no build.
stage "docs: links and anchors of README.md and docs/ (scripts/check-links.py)"
python3 scripts/check-links.py
stage "docs: the manual against the code (tests/docs)"
python3 -m unittest discover -s tests/docs

stage "cargo fmt --check"
cargo fmt --all -- --check

stage "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets -- -D warnings

stage "systemd units (systemd-analyze verify)"
scripts/verify-units.sh

# engine/tests/keys.rs checks our key files against the real `openssl`
# tool and fails without it; install it where we may.
if ! command -v openssl >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing openssl for the key-file interop tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        openssl >/dev/null; } || echo "test: warning: could not install openssl" >&2
  else
    echo "test: openssl missing and not root with apt: the key-file interop tests will fail" >&2
  fi
fi

# edge-bin/tests/etcd_client.rs runs a real etcd (/usr/bin/etcd, Debian's
# etcd-server) and fails without it; install it where we may.
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing etcd-server for the etcd client tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        etcd-server >/dev/null; } || echo "test: warning: could not install etcd-server" >&2
  else
    echo "test: etcd missing and not root with apt: the etcd client tests will fail" >&2
  fi
fi

stage "build binaries (integration tests run them)"
cargo build --workspace --bins

stage "unit, integration and simulation tests"
# The simulation replays its fixed seeds and then explores from a fresh base
# seed; pick it here so it is printed whether or not the run fails
# (IOP_SIM_FRESH_SEED=<seed> repeats that pass exactly).
if [ -z "${IOP_SIM_FRESH_SEED:-}" ]; then
  IOP_SIM_FRESH_SEED="0x$(od -An -N8 -tx8 /dev/urandom | tr -d ' \n')"
fi
export IOP_SIM_FRESH_SEED
echo "control_sim: fresh base seed $IOP_SIM_FRESH_SEED (IOP_SIM_FRESH_SEED)"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
  stage "doc tests"
  cargo test --workspace --doc
else
  cargo test --workspace
fi

report_disk

if [ "$run_e2e" = 1 ]; then
  stage "end-to-end (real processes, official SDKs), io_uring driver"
  scripts/e2e.sh
  stage "end-to-end again on the epoll fallback (MONOIO_FORCE_LEGACY_DRIVER=1)"
  MONOIO_FORCE_LEGACY_DRIVER=1 scripts/e2e.sh
fi

if [ "$run_fuzz" = 1 ]; then
  stage "fuzz: replay the committed corpora, then every target briefly"
  scripts/fuzz.sh --ci
fi

report_disk

stage "contract coverage"
if [ -x ../shared/tools/contract-coverage ]; then
  ../shared/tools/contract-coverage . | tail -n 1
else
  echo "(contract-coverage tool not present beside this checkout; skipped)"
fi

echo
echo "scripts/test.sh: all stages passed"
