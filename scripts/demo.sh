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
#   scripts/demo.sh --cluster       # three Edges of one cluster on one etcd
#                                   # (client API on 127.0.0.1:8080, 8081, 8082)
#
# The binaries are built into cargo's target directory (CARGO_TARGET_DIR or
# build.target-dir are honoured). The configs, certificates and the three
# logs (mock.log, edge.log, node.log) stay in the demo directory after exit;
# its path is printed at the start and at the end.
#
# --cluster: an etcd (the `etcd` binary: Debian's etcd-server package), three
# Edges sharing the fleet through it ([cluster] in edge-<n>.toml, one
# certificate per Edge from one CA, a peer listener each) and two Nodes that
# list all three Edges (edge_addr and edge_name lists) and dial one of them at
# random. A completion is streamed through every Edge: one that owns no node
# of the model forwards it to the Edge that owns them. Logs: etcd.log,
# mock.log, edge-1.log … edge-3.log, node-a.log, node-b.log.
set -euo pipefail
cd "$(dirname "$0")/.."

cluster=0
case ${1:-} in
  "") ;;
  --cluster) cluster=1 ;;
  *) echo "usage: scripts/demo.sh [--cluster]" >&2; exit 2 ;;
esac
if [ "$cluster" = 1 ]; then
  etcd_bin=$(command -v etcd || true)
  if [ -z "$etcd_bin" ]; then
    echo "demo.sh --cluster needs etcd, which is not installed (no etcd on PATH)." >&2
    echo "Install it: apt-get install etcd-server (Debian, Ubuntu), or put the etcd binary of a release" >&2
    echo "from https://github.com/etcd-io/etcd/releases on PATH." >&2
    exit 2
  fi
fi

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
  if [ "$cluster" = 1 ]; then
    # etcd's data (tens of MB of preallocated log) is not worth keeping.
    rm -rf "$work/etcd"
    echo "==> stopped; logs kept in $work (etcd.log, mock.log, edge-1.log … edge-3.log, node-a.log, node-b.log)"
  else
    echo "==> stopped; logs kept in $work (mock.log, edge.log, node.log)"
  fi
}
trap cleanup EXIT
trap 'exit 0' INT TERM

# Prints the [[nodes]] table of node $1 for edge.toml: the mock (at $mock)
# as its one provider, mock-1.
node_table() {
  cat <<TOML
[[nodes]]
id = "$1"
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
TOML
}

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

# Prints the streamed completion of $1 (a client address) as text.
stream_hello() {
  curl -sN "http://$1/v1/chat/completions" \
    -H 'content-type: application/json' \
    -d '{"model":"demo-model","stream":true,"messages":[{"role":"user","content":"Hello, IOP!"}]}' \
  | sed -un 's/^data: //p' | while IFS= read -r event; do
      [ "$event" = "[DONE]" ] && break
      printf '%s' "$(python3 -c 'import json,sys; e=json.loads(sys.argv[1]); c=e.get("choices") or [{}]; print(c[0].get("delta",{}).get("content") or "", end="")' "$event")"
    done
}

cluster_demo() {
  local edges=(edge-1 edge-2 edge-3) nodes=(node-a node-b)
  echo "==> minting dev certificates in $work/certs (one CA; a certificate per Edge and per Node)"
  "$bin/edge-bin" certs --out "$work/certs" --trust-domain iop.local \
    --edge-name edge-1 --edge-name edge-2 --edge-name edge-3 --node node-a --node node-b >/dev/null

  local etcd_ports etcd_client etcd_peer
  etcd_ports=$(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))')
  read -r etcd_client etcd_peer <<<"$etcd_ports"
  echo "==> starting etcd ($etcd_bin) on 127.0.0.1:$etcd_client, data in $work/etcd"
  "$etcd_bin" --name demo --data-dir "$work/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_client" --advertise-client-urls "http://127.0.0.1:$etcd_client" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "demo=http://127.0.0.1:$etcd_peer" >"$work/etcd.log" 2>&1 &
  pids+=($!)
  local etcd_pid=$!
  for _ in $(seq 1 300); do
    curl -fsS "http://127.0.0.1:$etcd_client/health" 2>/dev/null | grep -q '"health":"true"' && break
    kill -0 "$etcd_pid" 2>/dev/null || { echo "etcd exited early:" >&2; cat "$work/etcd.log" >&2; return 1; }
    sleep 0.1
  done

  echo "==> starting the mock provider"
  "$bin/bench" mock-provider --port 0 --ttft-ms 100 --inter-token-ms 40 --tokens 24 >"$work/mock.log" 2>&1 &
  pids+=($!)
  local mock
  mock=$(ready_value "$work/mock.log" addr $!)

  local i name client_port clients=() node_addrs=() edge_pids=()
  for i in 0 1 2; do
    name=${edges[$i]}
    if [ "$port" = 0 ]; then client_port=0; else client_port=$((port + i)); fi
    cat >"$work/$name.toml" <<TOML
[edge]
name = "$name"
trust_domain = "iop.local"
client_listen = "127.0.0.1:$client_port"
node_listen = "127.0.0.1:0"
# A loopback demo without client keys: say so.
allow_anonymous = true
[tls]
ca = "certs/ca.pem"
cert = "certs/edge-$name.pem"
key = "certs/edge-$name-key.pem"
# This Edge is one of several sharing the fleet through etcd.
[cluster]
name = "demo"
etcd_endpoints = ["127.0.0.1:$etcd_client"]
# Requests for a model whose nodes other Edges own are forwarded to them
# over mTLS; this is where the others forward theirs (announced in etcd).
peer_listen = "127.0.0.1:0"
TOML
    for node in "${nodes[@]}"; do
      node_table "$node" >>"$work/$name.toml"
    done
    cat >>"$work/$name.toml" <<TOML
[[models]]
name = "demo-model"
providers = ["node-a/mock-1", "node-b/mock-1"]
TOML
    echo "==> starting edge-bin $name"
    "$bin/edge-bin" --config "$work/$name.toml" --cores "$cores" >"$work/$name.log" 2>&1 &
    pids+=($!)
    edge_pids+=($!)
    clients+=("$(ready_value "$work/$name.log" client $!)")
    node_addrs+=("$(ready_value "$work/$name.log" nodes "${pids[-1]}")")
  done

  local addr_list name_list
  addr_list=$(printf '"%s", ' "${node_addrs[@]}"); addr_list="[${addr_list%, }]"
  name_list=$(printf '"%s", ' "${edges[@]}"); name_list="[${name_list%, }]"
  for node in "${nodes[@]}"; do
    cat >"$work/$node.toml" <<TOML
node_id = "$node"
trust_domain = "iop.local"
# Every Edge of the cluster; each dial picks one at random.
edge_addr = $addr_list
edge_name = $name_list
[tls]
ca = "certs/ca.pem"
cert = "certs/node-$node.pem"
key = "certs/node-$node-key.pem"
[reconnect]
interval_sec = 1
max_attempts = 0
TOML
    echo "==> starting node-bin $node"
    "$bin/node-bin" --config "$work/$node.toml" --cores "$cores" >"$work/$node.log" 2>&1 &
    pids+=($!)
  done

  # Who owns which node, as edge-1's /status says (cluster.nodes), once
  # both nodes are owned and connected to their owners and every Edge sees
  # the same owners.
  local owners=""
  for _ in $(seq 1 300); do
    owners=$(python3 - "${clients[@]}" <<'PY' 2>/dev/null || true
import json, sys, urllib.request
def status(addr):
    return json.load(urllib.request.urlopen(f"http://{addr}/status", timeout=2))
names = ["edge-1", "edge-2", "edge-3"]
owners = {n["node_id"]: n["edge"] for n in status(sys.argv[1])["cluster"]["nodes"]}
assert set(owners) == {"node-a", "node-b"}
for node, edge in owners.items():
    doc = status(sys.argv[1 + names.index(edge)])
    assert any(p["node_id"] == node and p["connected"] for p in doc["providers"])
for addr in sys.argv[1:]:
    assert {n["node_id"]: n["edge"] for n in status(addr)["cluster"]["nodes"]} == owners
print(" ".join(f"{node}={edge}" for node, edge in sorted(owners.items())))
PY
)
    [ -n "$owners" ] && break
    sleep 0.1
  done
  [ -n "$owners" ] || { echo "the nodes did not register in time; see $work/*.log" >&2; return 1; }

  # How many of the model's nodes Edge $1 owns.
  owned_by() {
    local entry n=0
    for entry in $owners; do [ "${entry#*=}" = "$1" ] && n=$((n + 1)); done
    echo "$n"
  }
  # Where a request entering at Edge $1 is served: there if it owns a node
  # of the model, else the Edge owning the most of them (ties: name order).

  echo "==> nodes owned: $owners"
  local i at
  for i in 0 1 2; do
    echo "==> streaming a chat completion through ${edges[$i]} (${clients[$i]}) → mTLS → node → provider"
    echo
    stream_hello "${clients[$i]}"
    echo
    # Where it went: the entry Edge's access line names the peer it
    # forwarded to (the owner with the most free slots), if any.
    at=$( { grep -o 'forwarded_to=edge-[0-9]*' "$work/${edges[$i]}.log" 2>/dev/null || true; } | tail -1 | cut -d= -f2)
    if [ -n "$at" ]; then
      echo "    (${edges[$i]} owns no node of the model: forwarded to $at over the peer link)"
    fi
    echo
  done
  local first_client=${clients[0]}

  echo "==> IOP is running as a cluster of three Edges (logs in $work/*.log):"
  echo
  for i in 0 1 2; do
    local owned=()
    for entry in $owners; do
      if [ "${entry#*=}" = "${edges[$i]}" ]; then owned+=("${entry%%=*}"); fi
    done
    echo "  ${edges[$i]}  client API http://${clients[$i]}/v1   (owns: ${owned[*]:-no node}; pid ${edge_pids[$i]})"
  done
  cat <<TXT

Point a client at any Edge: one that owns none of the model's nodes (/status →
cluster.nodes says who owns what) forwards the request to the Edge that owns
them, one hop more. Put the Edges behind one load balancer that checks /readyz.

  curl -sN http://$first_client/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"demo-model","stream":true,"messages":[{"role":"user","content":"hi"}]}'

  curl -s http://$first_client/status     # providers and the cluster view (cluster.nodes)

Kill an Edge that owns a node (kill -9 <its pid>) and its node registers with
another Edge within a few seconds (curl -s http://<another edge>/status); the
other Edges keep answering, and the dead Edge leaves cluster.edges when its
etcd lease expires (10 s).

Press Ctrl-C to stop.
TXT
  wait
}

if [ "$cluster" = 1 ]; then
  cluster_demo
  exit 0
fi

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
TOML
node_table node-a >>"$work/edge.toml"
cat >>"$work/edge.toml" <<TOML
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
