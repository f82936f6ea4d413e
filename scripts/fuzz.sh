#!/usr/bin/env bash
# Fuzzes every decoder (the targets in fuzz/fuzz_targets) on the stable
# toolchain with libFuzzer (cargo-fuzz, no sanitizer).
#
#   scripts/fuzz.sh [SECONDS]        every target SECONDS each (default 60),
#                                    after replaying the committed corpora
#   scripts/fuzz.sh --ci [SECONDS]   the scripts/test.sh stage: replay the
#                                    committed corpora, then SECONDS (default
#                                    3) per target, with a debug build
#   scripts/fuzz.sh --replay         only replay the committed corpora
#   scripts/fuzz.sh --runs N         every target for N executions (the long
#                                    run reported in fuzz/README.md)
#   scripts/fuzz.sh ... --target T   only target T (repeatable)
#
# Committed corpora: fuzz/seeds/<target>/ (hand-written inputs and a
# minimized corpus) and fuzz/regressions/<target>/ (every crash found, kept
# after its fix). A replay runs each file once; any crash fails the script.
# New corpus entries go to fuzz/corpus/<target>/ and crashes to
# fuzz/artifacts/<target>/ (both ignored by git). Installs cargo-fuzz when
# it is missing.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

mode=fuzz
seconds=""
runs=""
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ci) mode=ci ;;
    --replay) mode=replay ;;
    --runs) runs="$2"; shift ;;
    --target) targets+=("$2"); shift ;;
    [0-9]*) seconds="$1" ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
if [ "${#targets[@]}" -eq 0 ]; then
  for f in fuzz_targets/*.rs; do targets+=("$(basename "$f" .rs)"); done
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "==> installing cargo-fuzz"
  # A debug build installs in half the time and runs just as well.
  cargo install cargo-fuzz --locked --debug --version 0.13.2
fi

# The CI stage favours build time (a debug build with optimizations for
# dependencies, see Cargo.toml); real fuzzing a release build.
if [ "$mode" = ci ]; then
  build=(--dev)
  profile=debug
  seconds="${seconds:-3}"
else
  build=(--release)
  profile=release
  seconds="${seconds:-60}"
fi
# Logs per target and mode: artifacts/<target>/<mode>-replay.log, <mode>.log
# (a CI stage never overwrites a long run's log).
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
echo "==> cargo fuzz build -s none ${build[*]}"
cargo fuzz build -s none "${build[@]}"
bin_dir="target/$(rustc -vV | sed -n 's/^host: //p')/$profile"

failed=()
for t in "${targets[@]}"; do
  mkdir -p "seeds/$t" "regressions/$t" "corpus/$t" "artifacts/$t"
  committed=$(find "seeds/$t" "regressions/$t" -type f | wc -l)
  echo "==> $t: replay $committed committed inputs"
  if ! "$bin_dir/$t" -runs=0 "seeds/$t" "regressions/$t" >"artifacts/$t/$mode-replay.log" 2>&1; then
    tail -n 40 "artifacts/$t/$mode-replay.log"
    failed+=("$t (replay)")
    continue
  fi
  [ "$mode" = replay ] && continue
  if [ -n "$runs" ]; then
    limit=(-runs="$runs")
    echo "==> $t: fuzz $runs executions"
  else
    limit=(-max_total_time="$seconds")
    echo "==> $t: fuzz ${seconds}s"
  fi
  # The writable corpus first; the committed ones seed it.
  if ! "$bin_dir/$t" "corpus/$t" "seeds/$t" "regressions/$t" "${limit[@]}" \
      -artifact_prefix="artifacts/$t/" -print_final_stats=1 \
      >"artifacts/$t/$mode.log" 2>&1; then
    tail -n 40 "artifacts/$t/$mode.log"
    failed+=("$t")
    continue
  fi
  grep -E '^stat::number_of_executed_units' "artifacts/$t/$mode.log" | sed "s/^/    $t /"
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz: failures in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets passed"
