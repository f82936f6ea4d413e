#!/usr/bin/env bash
# Mints a development CA plus Edge and Node certificates with SPIFFE URI SANs
# (spiffe://<trust-domain>/edge/<name>, spiffe://<trust-domain>/node/<name>).
#
#   scripts/dev-certs.sh OUT_DIR [TRUST_DOMAIN] [EDGE_NAME] [NODE_ID...]
#
# Defaults: trust domain iop.local, edge edge-1, node node-a. Private keys are
# written with mode 0600. For development and tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/dev-certs.sh OUT_DIR [TRUST_DOMAIN] [EDGE_NAME] [NODE_ID...]}
td=${2:-iop.local}
edge=${3:-edge-1}
shift $(( $# < 3 ? $# : 3 ))
nodes=("$@")
[ ${#nodes[@]} -gt 0 ] || nodes=(node-a)
args=()
for n in "${nodes[@]}"; do args+=(--node "$n"); done
cargo build --quiet --bin edge-bin
exec target/debug/edge-bin certs --out "$out" --trust-domain "$td" --edge-name "$edge" "${args[@]}"
