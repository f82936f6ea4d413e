#!/usr/bin/env bash
# The whole system on loopback: a mock OpenAI-compatible provider, an Edge and a
# Node connected over mutual TLS. Streams one chat completion through them,
# prints how to use it from the OpenAI SDK, and keeps running until Ctrl-C.
#
#   scripts/demo.sh                 # client API on 127.0.0.1:8080
#   IOP_DEMO_PORT=9090 scripts/demo.sh
#   IOP_DEMO_CORES=0-1 scripts/demo.sh   # both binaries on two cores (--cores)
#   IOP_DEMO_DIR=/tmp/demo scripts/demo.sh   # configs, certificates and logs there
#   IOP_DEMO_PROFILE=dev scripts/demo.sh     # debug binaries (faster to build)
#
# The binaries are built into cargo's target directory (CARGO_TARGET_DIR or
# build.target-dir are honoured). The configs, certificates and the three
# logs (mock.log, edge.log, node.log) stay in the demo directory after exit;
# its path is printed at the start and at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

port=${IOP_DEMO_PORT:-8080}
cores=${IOP_DEMO_CORES:-0}
profile=${IOP_DEMO_PROFILE:-release}
case $profile in
  release) profile_dir=release ;;
  dev) profile_dir=debug ;;
  *) echo "IOP_DEMO_PROFILE must be release or dev, not $profile" >&2; exit 2 ;;
esac
echo "==> building $profile binaries (the first release build takes a few minutes)"
cargo build --profile "$profile" --bins --quiet
target_dir=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
bin=$target_dir/$profile_dir
echo "==> binaries from $bin"

if [ -n "${IOP_DEMO_DIR:-}" ]; then
  work=$IOP_DEMO_DIR
  mkdir -p "$work"
else
  work=$(mktemp -d -t iop-demo.XXXXXX)
fi
echo "==> configs, certificates and logs in $work"
pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "==> stopped; logs kept in $work (mock.log, edge.log, node.log)"
}
trap cleanup EXIT
trap 'exit 0' INT TERM

# Waits for `IOP_READY` in a log file and prints the value of key $2.
ready_value() {
  local log=$1 key=$2 pid=$3
  for _ in $(seq 1 300); do
    if line=$(grep -m1 '^IOP_READY ' "$log" 2>/dev/null); then
      tr ' ' '\n' <<<"$line" | sed -n "s/^$key=//p"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "process exited early:" >&2; cat "$log" >&2; return 1; }
    sleep 0.1
  done
  echo "timed out waiting for $log" >&2; return 1
}

echo "==> minting dev certificates in $work/certs"
"$bin/edge-bin" certs --out "$work/certs" --trust-domain iop.local --edge-name edge-1 --node node-a >/dev/null

echo "==> starting the mock provider"
"$bin/bench" mock-provider --port 0 --ttft-ms 100 --inter-token-ms 40 --tokens 24 >"$work/mock.log" 2>&1 &
pids+=($!)
mock=$(ready_value "$work/mock.log" addr $!)

cat >"$work/edge.toml" <<TOML
[edge]
name = "edge-1"
trust_domain = "iop.local"
client_listen = "127.0.0.1:$port"
node_listen = "127.0.0.1:0"
# A loopback demo without client keys: say so.
allow_anonymous = true
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge-key.pem"
[[nodes]]
id = "node-a"
[[nodes.adapters]]
name = "mock"
kind = "openai_compat"
profile = "openai"
base_url = "http://$mock"
capacity = 64
[[nodes.providers]]
id = "mock-1"
adapter = "mock"
target = "mock-model"
capacity = 64
[[models]]
name = "demo-model"
providers = ["node-a/mock-1"]
TOML

echo "==> starting edge-bin"
"$bin/edge-bin" --config "$work/edge.toml" --cores "$cores" >"$work/edge.log" 2>&1 &
pids+=($!)
client=$(ready_value "$work/edge.log" client $!)
nodes=$(ready_value "$work/edge.log" nodes "${pids[-1]}")

cat >"$work/node.toml" <<TOML
node_id = "node-a"
trust_domain = "iop.local"
edge_addr = "$nodes"
edge_name = "edge-1"
[tls]
ca = "certs/ca.pem"
cert = "certs/node-node-a.pem"
key = "certs/node-node-a-key.pem"
[reconnect]
interval_sec = 1
max_attempts = 0
TOML

echo "==> starting node-bin"
"$bin/node-bin" --config "$work/node.toml" --cores "$cores" >"$work/node.log" 2>&1 &
pids+=($!)

for _ in $(seq 1 100); do
  curl -fsS "http://$client/status" 2>/dev/null | grep -q '"connected":true' && break
  sleep 0.1
done

echo "==> streaming a chat completion through edge → mTLS → node → provider"
echo
curl -sN "http://$client/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d '{"model":"demo-model","stream":true,"messages":[{"role":"user","content":"Hello, IOP!"}]}' \
| sed -un 's/^data: //p' | while IFS= read -r event; do
    [ "$event" = "[DONE]" ] && break
    printf '%s' "$(python3 -c 'import json,sys; e=json.loads(sys.argv[1]); c=e.get("choices") or [{}]; print(c[0].get("delta",{}).get("content") or "", end="")' "$event")"
  done
echo; echo

cat <<TXT
==> IOP is running (logs in $work/*.log). Try it:

  curl -sN http://$client/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"demo-model","stream":true,"messages":[{"role":"user","content":"hi"}]}'

  python3 - <<'PY'
  from openai import OpenAI
  client = OpenAI(base_url="http://$client/v1", api_key="unused")
  for chunk in client.chat.completions.create(model="demo-model", stream=True,
                                              messages=[{"role": "user", "content": "hi"}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
  print()
  PY

  curl -s http://$client/status     # provider snapshots

Press Ctrl-C to stop.
TXT
wait
