#!/usr/bin/env bash
# Relay-vs-direct benchmark: builds release binaries, then runs `bench compare`,
# which starts a mock provider, an Edge and a Node on loopback and measures the
# relayed path against the direct one side by side (latency added, CPU per
# relayed token, memory per stream) at 1 and 200 concurrent streams, and a
# concurrency ladder. Prints a table and writes a JSON report to
# bench/results/compare-<unix-ts>.json.
#
#   scripts/bench.sh                 the standard suite (about 3½ minutes on 2 cores)
#   scripts/bench.sh --quick         a short run (about a minute after the build)
#   scripts/bench.sh --peer-nginx    also measure a plain nginx reverse proxy in front
#                                    of the mock (arm C): its latency, the CPU and memory
#                                    of its master and worker processes, and IOP ÷ nginx
#                                    against the relay's goals
#   scripts/bench.sh --peer-nginx-chain
#                                    arm C is instead the relay's own shape built of nginx:
#                                    two nginx in series with mutual TLS (TLS 1.3, ECDSA
#                                    certificates minted by openssl) between them, the front
#                                    one pinned on the Edge's CPU and the back one on the
#                                    Node's; the peer is named nginx-chain
#   scripts/bench.sh --peer-vllm-router
#                                    arm C is instead vllm-router 0.1.17, the vLLM project's
#                                    router (Rust, from PyPI, installed with pip into
#                                    bench/.venv-peers on first use): one process, one tokio
#                                    worker thread, round robin over one worker, the mock
#   The --peer-* options are one per run. What a peer needs is installed when missing:
#   nginx and openssl as root with apt-get (no service started), vllm-router with pip;
#   where that cannot be done the run stops with an error rather than go on without arm C.
#   scripts/bench.sh --cores-scaling instead of the comparison, run `bench cores`: bulk relay
#                                    throughput (body bytes/s of 256 x 4 KiB-token streams,
#                                    32 concurrent) with edge-bin and node-bin on --cores 0
#                                    vs --cores 0-1, against a direct baseline, in alternating
#                                    rounds; prints the ratio and writes
#                                    bench/results/cores-<unix-ts>.json (about 2 minutes;
#                                    --quick: about 30 s)
#   scripts/bench.sh --cache-routing instead of the comparison, run `bench cache-routing`: the
#                                    Edge's routing policies (least_loaded, session, prefix,
#                                    and pinned models as the yardstick) over 2 and 4 mock
#                                    providers that model a prefix cache, on multi-turn,
#                                    shared-system-prompt and no-shared-prefix workloads;
#                                    TTFT, cache hit rate, req/s and the goal ratios as a
#                                    markdown table; writes
#                                    bench/results/cache-routing-<unix-ts>.json
#                                    (docs/bench-cache-routing.md; --quick: under a minute)
#   scripts/bench.sh --fairness      instead of the comparison, run `bench fairness`: one
#                                    model of capacity 4 shared by key A (a flood at 10x
#                                    capacity) and key B (a low rate, then 1.5x capacity),
#                                    with the queue in arrival order (both keys one
#                                    principal), weighted fair queueing 1:1 and B
#                                    interactive against A batch; B's queue wait p50/p99,
#                                    each key's share of the admissions per window while
#                                    both are backlogged and the 1:1 goal, as a markdown
#                                    table; writes bench/results/fairness-<unix-ts>.json
#                                    (docs/bench-fairness.md; about 3 minutes; --quick:
#                                    about 1½)
#   After the comparison (standard, --quick, with or without a --peer-* option), `bench
#   instructions` counts the user-space instructions per relayed token of the Edge and the
#   Node under callgrind (valgrind, installed when missing and run as root with apt), and of
#   the peer, started again under callgrind (nginx as one process, two for the chain;
#   vllm-router as before, with one worker thread), over the same load; prints them next
#   to the ratios with the <= 6,000 goal and writes
#   bench/results/instructions-<unix-ts>.json (about 1½ minutes; --quick: 1 round; with
#   vllm-router half a minute more for its start under callgrind).
#   scripts/bench.sh --no-instructions   the comparison without the instruction counts
#   scripts/bench.sh --bin-dir DIR   measure the binaries in DIR (an older build, say)
#                                    instead of building target/release
#   scripts/bench.sh --swarm         instead of the comparison, run `bench swarm`: one Edge and
#                                    10, 100 and 1,000 simulated Nodes (each its own mTLS
#                                    connection and certificate) in one process: Edge RSS per
#                                    node, cold start and SIGKILL + restart recovery (jitter on
#                                    and off), dispatch latency, heartbeat CPU, Control's
#                                    decision costs; writes bench/results/swarm-<unix-ts>.json
#                                    (about 3 minutes; --quick: about 40 s)
#   scripts/bench.sh --swarm-cluster instead of the comparison, run `bench swarm --cluster 3`:
#                                    one etcd, three Edges of one cluster (each --cores 0, its
#                                    own name and certificate, etcd lease 4 s) and 1,000
#                                    simulated Nodes dialling all three in a fresh shuffled
#                                    order; one Edge is SIGKILLed and the re-homing of its
#                                    nodes is measured (time until all ready again, per-node
#                                    p50/p99/max, lease expiry, /status ownership); writes
#                                    bench/results/swarm-cluster-<unix-ts>.json (needs the etcd
#                                    binary: apt-get install etcd-server; about a minute;
#                                    --quick: 200 nodes, 1 s reconnect)
#   scripts/bench.sh -- ARGS...      pass ARGS on to `bench compare` (or `bench cores` with
#                                    --cores-scaling, `bench swarm` with --swarm or
#                                    --swarm-cluster, `bench cache-routing` with
#                                    --cache-routing, `bench fairness` with --fairness;
#                                    see `bench compare --help`)
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
peer="" # arm C: nginx, nginx-chain or vllm-router
cores_scaling=0
swarm=0
swarm_cluster=0
cache_routing=0
fairness=0
instructions=1
extra=()
bin_dir=""
# One peer per run: a second --peer-* option is an error, not a choice.
set_peer() {
  if [ -n "$peer" ] && [ "$peer" != "$1" ]; then
    echo "--peer-$peer and --peer-$1 together: arm C is one peer per run" >&2
    exit 2
  fi
  peer=$1
}
while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) shift; bin_dir=$(cd "${1:?--bin-dir needs a directory}" && pwd) ;;
    --quick) quick=1 ;;
    --peer-nginx) set_peer nginx ;;
    --peer-nginx-chain) set_peer nginx-chain ;;
    --peer-vllm-router) set_peer vllm-router ;;
    --cores-scaling) cores_scaling=1 ;;
    --swarm) swarm=1 ;;
    --swarm-cluster) swarm_cluster=1 ;;
    --cache-routing) cache_routing=1 ;;
    --fairness) fairness=1 ;;
    --no-instructions) instructions=0 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ -n "$bin_dir" ]; then
  bin=$bin_dir
else
  echo "==> building release binaries"
  cargo build --release --workspace --bins --quiet
  bin=$PWD/target/release
fi

if [ "$fairness" = 1 ]; then
  if [ -n "$peer" ] || [ "$cores_scaling" = 1 ] || [ "$swarm" = 1 ] || [ "$swarm_cluster" = 1 ] \
    || [ "$cache_routing" = 1 ]; then
    echo "--fairness runs on its own: without a --peer-* option, --cores-scaling, --swarm and --cache-routing" >&2
    exit 2
  fi
  # One open socket per queued request of the flood: raise the soft
  # open-file limit to the hard one (bench fairness does too).
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
  mkdir -p bench/results
  args=(fairness --bin-dir "$bin" --json "bench/results/fairness-$(date +%s).json")
  if [ "$quick" = 1 ]; then args+=(--quick); fi
  echo "==> $bin/bench ${args[*]} ${extra[*]}"
  exec "$bin/bench" "${args[@]}" "${extra[@]}"
fi

if [ "$cache_routing" = 1 ]; then
  if [ -n "$peer" ] || [ "$cores_scaling" = 1 ] || [ "$swarm" = 1 ] || [ "$swarm_cluster" = 1 ]; then
    echo "--cache-routing runs on its own: without a --peer-* option, --cores-scaling and --swarm" >&2
    exit 2
  fi
  mkdir -p bench/results
  args=(cache-routing --bin-dir "$bin" --json "bench/results/cache-routing-$(date +%s).json")
  if [ "$quick" = 1 ]; then args+=(--quick); fi
  echo "==> $bin/bench ${args[*]} ${extra[*]}"
  exec "$bin/bench" "${args[@]}" "${extra[@]}"
fi

if [ "$swarm" = 1 ] || [ "$swarm_cluster" = 1 ]; then
  if [ -n "$peer" ] || [ "$cores_scaling" = 1 ] || [ "$swarm$swarm_cluster" = 11 ]; then
    echo "--swarm and --swarm-cluster run on their own: use one, without a --peer-* option and --cores-scaling" >&2
    exit 2
  fi
  # One socket per node in the harness and in the Edge: raise the soft
  # open-file limit to the hard one (bench swarm does too, and says so).
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
  args=(swarm --bin-dir "$bin" --out bench/results)
  if [ "$swarm_cluster" = 1 ]; then args+=(--cluster 3); fi
  if [ "$quick" = 1 ]; then args+=(--quick); fi
  echo "==> $bin/bench ${args[*]} ${extra[*]}"
  exec "$bin/bench" "${args[@]}" "${extra[@]}"
fi

if [ "$cores_scaling" = 1 ]; then
  if [ -n "$peer" ]; then
    echo "--peer-$peer applies to the comparison, not to --cores-scaling" >&2
    exit 2
  fi
  args=(cores --bin-dir "$bin" --out bench/results)
  if [ "$quick" = 1 ]; then args+=(--quick); fi
  echo "==> $bin/bench ${args[*]} ${extra[*]}"
  exec "$bin/bench" "${args[@]}" "${extra[@]}"
fi

args=(compare --bin-dir "$bin" --out bench/results)
if [ "$quick" = 1 ]; then args+=(--quick); fi

work=""
started_pids=() # the peers (and stand-in mocks) this script started, ended at exit
policy_rc_d=""  # a policy-rc.d written for an install, removed after it
cleanup() {
  trap - EXIT
  local pid
  for pid in "${started_pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ -n "$work" ]; then rm -rf "$work"; fi
  if [ -n "$policy_rc_d" ]; then rm -f "$policy_rc_d"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Ends process $1, which this script started, and waits for it.
stop_pid() {
  local pid kept=()
  kill -TERM "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
  for pid in "${started_pids[@]}"; do
    if [ "$pid" != "$1" ]; then kept+=("$pid"); fi
  done
  started_pids=("${kept[@]}")
}

# Installs the Debian packages $@ quietly, without recommends, as root with
# apt-get; fails when that cannot be done. No service a package ships is
# started meanwhile: nginx's would serve port 80 and run beside every
# benchmark after, and where port 80 is taken its start, and so the install,
# would fail. So, unless the machine has its own /usr/sbin/policy-rc.d (its
# owner's word, kept), one that answers 101 ("action forbidden") stands for
# the install, and on a host run by systemd the installed service is not
# enabled either (the script runs nginx itself, on its own ports).
apt_updated=0
apt_install() {
  local status=0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    return 1
  fi
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy_rc_d=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' >"$policy_rc_d"
    chmod 755 "$policy_rc_d"
  fi
  if [ "$apt_updated" = 0 ]; then
    if apt-get update -qq; then apt_updated=1; else status=1; fi
  fi
  if [ "$status" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null \
      || status=1
  fi
  if [ -n "$policy_rc_d" ]; then
    rm -f "$policy_rc_d"
    policy_rc_d=""
  fi
  return "$status"
}

# Command $1 on PATH, from Debian package $2 when missing; exits when it
# cannot be had: the run was asked for what needs it ($3).
require_command() {
  local cmd=$1 package=$2 what=$3
  command -v "$cmd" >/dev/null 2>&1 && return 0
  echo "==> $cmd is not installed: installing the $package package for $what"
  if ! apt_install "$package" || ! command -v "$cmd" >/dev/null 2>&1; then
    echo "$cmd is needed for $what and could not be installed: run as root on a machine" \
      "with apt-get, or install $package yourself" >&2
    exit 1
  fi
  if [ "$package" = nginx ] && [ -d /run/systemd/system ]; then
    systemctl disable --now --quiet nginx 2>/dev/null || true
  fi
}

# Whether something accepts connections on 127.0.0.1:$1.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A loopback port no socket uses (the mock and nginx bind it shortly
# after), below the kernel's ephemeral range: a port in that range may be
# taken meanwhile by the source port of any outgoing connection (the relay's
# own included), and then the bind fails with EADDRINUSE.
free_port() {
  local port low
  low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  if [ "$low" -le 11000 ]; then low=32768; fi
  for _ in $(seq 1 100); do
    port=$((10000 + RANDOM % (low - 10000)))
    [ "$port" = "${1:-}" ] && continue
    listening "$port" && continue
    # Any socket (listening, connected, TIME_WAIT) with this local port.
    if command -v ss >/dev/null 2>&1 && [ -n "$(ss -Htan "sport = :$port" 2>/dev/null)" ]; then
      continue
    fi
    echo "$port"
    return 0
  done
  echo "no free port found" >&2
  return 1
}

# The CPUs this script may run on, in order (from Cpus_allowed_list, e.g.
# `0-1` or `0,2-3`): the Edge gets the first and the Node the second, and
# so do the two nginx of --peer-nginx-chain.
allowed_cpus() {
  local list part
  list=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status)
  IFS=, read -ra parts <<<"$list"
  for part in "${parts[@]}"; do
    if [[ $part == *-* ]]; then seq "${part%-*}" "${part#*-}"; else echo "$part"; fi
  done
}

# Writes $1/nginx.conf: one worker, no access log, listening as $2 (an nginx
# `listen` argument), proxying everything to 127.0.0.1:$3 over $4 (http or
# https) with HTTP/1.1 keep-alive upstream connections and nothing buffered
# (each token goes on as it comes). $5 is added to the server block and $6
# to its location (TLS settings), one directive per line.
nginx_conf() {
  local dir=$1 listen=$2 upstream_port=$3 scheme=$4 server_extra=${5:-} location_extra=${6:-}
  local master=${NGINX_MASTER:-on}
  cat >"$dir/nginx.conf" <<NGINX
daemon off;
master_process $master;
worker_processes 1;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 16384; }
http {
  access_log off;
  client_body_temp_path $dir/client_body;
  proxy_temp_path $dir/proxy;
  fastcgi_temp_path $dir/fastcgi;
  uwsgi_temp_path $dir/uwsgi;
  scgi_temp_path $dir/scgi;
  keepalive_requests 1000000;
  keepalive_timeout 300s;
  upstream next_hop {
    server 127.0.0.1:$upstream_port;
    keepalive 256;
    keepalive_timeout 300s;
  }
  server {
    listen $listen;
$server_extra
    location / {
      proxy_pass $scheme://next_hop;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
$location_extra
    }
  }
}
NGINX
}

# Starts nginx with the config $1/nginx.conf, pinned to CPU $2 when one is
# given, on port $3; waits until it listens and appends its master and
# workers to peer_pids (bench compare sums their CPU and memory).
start_nginx() {
  local dir=$1 cpu=$2 port=$3 pid workers=""
  if [ -n "$cpu" ] && command -v taskset >/dev/null 2>&1; then
    taskset -c "$cpu" nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" &
  else
    nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" &
  fi
  pid=$!
  started_pids+=("$pid")
  for _ in $(seq 1 100); do
    listening "$port" && break
    kill -0 "$pid" 2>/dev/null || { echo "nginx exited:" >&2; cat "$dir/error.log" >&2; exit 1; }
    sleep 0.05
  done
  # The master may listen before it forks its workers.
  peer_pids+=("$pid")
  if command -v pgrep >/dev/null 2>&1; then
    for _ in $(seq 1 40); do
      workers=$(pgrep -P "$pid" || true)
      [ -n "$workers" ] && break
      sleep 0.05
    done
    for w in $workers; do peer_pids+=("$w"); done
  fi
  if [ -z "$workers" ]; then
    echo "==> nginx's worker processes not found (no pgrep?): sampling its master only" >&2
  fi
}

# A CA, a server certificate for the back nginx and a client certificate
# for the front one (ECDSA P-256, as the relay's own), in $1.
mint_chain_certs() {
  local dir=$1 name
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=iop-bench-ca -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
  for name in back front; do
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
      -subj "/CN=iop-bench-$name" -addext "subjectAltName=DNS:iop-bench-$name" \
      -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
      -CAcreateserial -days 2 -copy_extensions copy -out "$dir/$name.crt" 2>/dev/null
  done
}

# vllm-router, the vLLM project's router (Rust, published on PyPI), for
# --peer-vllm-router: this version, in a virtual environment of its own
# (bench/.venv-peers, git-ignored), made on first use and kept.
vllm_router_version=0.1.17
peers_venv=$PWD/bench/.venv-peers

# Makes sure vllm-router $vllm_router_version is in $peers_venv; exits when
# it cannot be installed.
install_vllm_router() {
  local have=""
  if [ -x "$peers_venv/bin/python" ]; then
    have=$("$peers_venv/bin/python" -c \
      'import importlib.metadata as m; print(m.version("vllm-router"))' 2>/dev/null || true)
  fi
  [ "$have" = "$vllm_router_version" ] && return 0
  if [ ! -x "$peers_venv/bin/python" ]; then
    require_command python3 python3 "vllm-router's virtual environment"
    if ! python3 -m venv "$peers_venv" >/dev/null 2>&1; then
      # Debian's python3 makes virtual environments only with python3-venv.
      rm -rf "$peers_venv"
      echo "==> installing python3-venv for vllm-router's virtual environment"
      apt_install python3-venv || true
      if ! python3 -m venv "$peers_venv"; then
        rm -rf "$peers_venv"
        echo "could not make a Python virtual environment in $peers_venv for vllm-router" \
          "(python3 -m venv; on Debian: apt-get install python3-venv)" >&2
        exit 1
      fi
    fi
  fi
  echo "==> installing vllm-router $vllm_router_version into bench/.venv-peers"
  if ! "$peers_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "vllm-router==$vllm_router_version"; then
    echo "could not install vllm-router $vllm_router_version into $peers_venv (pip install failed)" >&2
    exit 1
  fi
}

# Starts vllm-router on 127.0.0.1:$2, its one worker the mock at
# 127.0.0.1:$mock_port, its log (and with $3 = callgrind, callgrind's
# dumps) in $1; waits until it listens and appends its PID to
# vllm_router_pid. Fails, saying why, when it exits or does not listen in
# time.
#
# It is one process with one tokio worker thread (TOKIO_WORKER_THREADS, as
# nginx has one worker process), round robin over its one worker (a plain
# hop: no prefix tree to keep, as the default cache_aware policy would).
# It answers nothing until its worker answers GET /health, and bench
# compare (or instructions) starts the mock only after the peer runs: so a
# stand-in mock serves the port while the router starts (polling every
# second, not the default 30) and is stopped once the router listens; the
# bench's own mock binds the port after it. Its metrics listener takes a
# port of its own (the default 29000 may be taken).
start_vllm_router() {
  local dir=$1 port=$2 under=${3:-} pid standin metrics_port tries=600 wrap=()
  vllm_router_pid=""
  metrics_port=$(free_port "$port")
  # Python's http.server, not a second bench mock: it answers HTTP/1.0 and
  # closes each connection itself, so no connection of the router's pool
  # is left half-closed on the port (a FIN_WAIT2 socket there, which
  # SO_REUSEADDR does not let the bench's mock bind past, is what a
  # keep-alive stand-in left behind). GET /health is the file `health`.
  mkdir -p "$dir/stand-in"
  echo ok >"$dir/stand-in/health"
  python3 -m http.server --bind 127.0.0.1 --directory "$dir/stand-in" "$mock_port" \
    >"$dir/stand-in-mock.log" 2>&1 &
  standin=$!
  started_pids+=("$standin")
  for _ in $(seq 1 100); do
    listening "$mock_port" && break
    kill -0 "$standin" 2>/dev/null || break
    sleep 0.05
  done
  if ! listening "$mock_port"; then
    echo "the stand-in mock for vllm-router's start did not listen on 127.0.0.1:$mock_port:" >&2
    cat "$dir/stand-in-mock.log" >&2
    return 1
  fi
  if [ "$under" = callgrind ]; then
    # Python's start under callgrind takes some 25 s on 2 vCPU.
    wrap=(valgrind --tool=callgrind "--callgrind-out-file=$dir/callgrind.%p" --dump-instr=no)
    tries=6000
  fi
  TOKIO_WORKER_THREADS=1 "${wrap[@]}" "$peers_venv/bin/vllm-router" --host 127.0.0.1 --port "$port" \
    --worker-urls "http://127.0.0.1:$mock_port" --policy round_robin \
    --worker-startup-check-interval 1 --prometheus-host 127.0.0.1 --prometheus-port "$metrics_port" \
    >"$dir/vllm-router.log" 2>&1 &
  pid=$!
  started_pids+=("$pid")
  for _ in $(seq 1 "$tries"); do
    listening "$port" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  stop_pid "$standin"
  if ! listening "$port"; then
    echo "vllm-router${under:+ under $under} did not listen on 127.0.0.1:$port:" >&2
    tail -n 20 "$dir/vllm-router.log" >&2
    stop_pid "$pid"
    return 1
  fi
  vllm_router_pid=$pid
}

peer_pids=()
if [ -n "$peer" ]; then
  case "$peer" in
    nginx) require_command nginx nginx "--peer-nginx" ;;
    nginx-chain)
      require_command nginx nginx "--peer-nginx-chain"
      require_command openssl openssl "--peer-nginx-chain's certificates"
      ;;
    vllm-router) install_vllm_router ;;
  esac
  work=$(mktemp -d -t iop-bench-peer.XXXXXX)
  chmod 755 "$work"
  mock_port=$(free_port)
  peer_port=$(free_port "$mock_port")
  case "$peer" in
    nginx)
      mkdir "$work/one"
      nginx_conf "$work/one" "127.0.0.1:$peer_port" "$mock_port" http
      echo "==> starting nginx on 127.0.0.1:$peer_port in front of the mock at 127.0.0.1:$mock_port"
      start_nginx "$work/one" "" "$peer_port"
      ;;
    nginx-chain)
      back_port=$(free_port "$peer_port")
      mapfile -t cpus < <(allowed_cpus)
      front_cpu=${cpus[0]:-}
      back_cpu=${cpus[1]:-$front_cpu}
      mkdir "$work/front" "$work/back"
      mint_chain_certs "$work"
      nginx_conf "$work/back" "127.0.0.1:$back_port ssl" "$mock_port" http "\
    ssl_protocols TLSv1.3;
    ssl_certificate $work/back.crt;
    ssl_certificate_key $work/back.key;
    ssl_client_certificate $work/ca.crt;
    ssl_verify_client on;"
      nginx_conf "$work/front" "127.0.0.1:$peer_port" "$back_port" https "" "\
      proxy_ssl_protocols TLSv1.3;
      proxy_ssl_certificate $work/front.crt;
      proxy_ssl_certificate_key $work/front.key;
      proxy_ssl_trusted_certificate $work/ca.crt;
      proxy_ssl_verify on;
      proxy_ssl_name iop-bench-back;
      proxy_ssl_session_reuse on;"
      echo "==> starting an nginx chain: 127.0.0.1:$peer_port (CPU ${front_cpu:-any}) → mTLS → 127.0.0.1:$back_port (CPU ${back_cpu:-any}) → the mock at 127.0.0.1:$mock_port"
      start_nginx "$work/back" "$back_cpu" "$back_port"
      start_nginx "$work/front" "$front_cpu" "$peer_port"
      ;;
    vllm-router)
      mkdir "$work/vllm-router"
      echo "==> starting vllm-router $vllm_router_version on 127.0.0.1:$peer_port in front of the mock at 127.0.0.1:$mock_port"
      start_vllm_router "$work/vllm-router" "$peer_port" || exit 1
      peer_pids+=("$vllm_router_pid")
      ;;
  esac
  args+=(--mock-port "$mock_port" --peer "http://127.0.0.1:$peer_port" --peer-name "$peer")
  for pid in "${peer_pids[@]}"; do args+=(--peer-pid "$pid"); done
fi

echo "==> $bin/bench ${args[*]} ${extra[*]}"
"$bin/bench" "${args[@]}" "${extra[@]}"

[ "$instructions" = 1 ] || exit 0

# The instruction counts: callgrind's, which noise does not move.
if ! command -v callgrind_control >/dev/null 2>&1; then
  echo "==> installing valgrind for the instruction counts"
  apt_install valgrind || echo "==> could not install valgrind" >&2
fi
if ! command -v callgrind_control >/dev/null 2>&1; then
  echo "==> valgrind is not installed: no instruction counts (apt-get install valgrind)"
  exit 0
fi

# nginx as one process (no master) under callgrind, listening on $2.
start_nginx_callgrind() {
  local dir=$1 port=$2 pid
  valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.%p" --dump-instr=no \
    nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" 2>"$dir/valgrind.log" &
  pid=$!
  started_pids+=("$pid")
  for _ in $(seq 1 600); do
    listening "$port" && break
    kill -0 "$pid" 2>/dev/null || { echo "nginx under callgrind exited:" >&2; cat "$dir/error.log" "$dir/valgrind.log" >&2; exit 1; }
    sleep 0.05
  done
  cg_pids+=("$pid")
}

iargs=(instructions --bin-dir "$bin" --json "bench/results/instructions-$(date +%s).json")
if [ "$quick" = 1 ]; then iargs+=(--rounds 1); fi
cg_pids=()
if [ -n "$peer" ]; then
  cg_port=$(free_port "$peer_port")
  export NGINX_MASTER=off
  case "$peer" in
    nginx)
      mkdir "$work/cg-one"
      nginx_conf "$work/cg-one" "127.0.0.1:$cg_port" "$mock_port" http
      echo "==> starting nginx under callgrind on 127.0.0.1:$cg_port"
      start_nginx_callgrind "$work/cg-one" "$cg_port"
      ;;
    nginx-chain)
      cg_back=$(free_port "$cg_port")
      mkdir "$work/cg-front" "$work/cg-back"
      sed -e "s|$work/back/|$work/cg-back/|g" -e "s|127.0.0.1:$back_port|127.0.0.1:$cg_back|" \
        -e "s|master_process on|master_process off|" "$work/back/nginx.conf" >"$work/cg-back/nginx.conf"
      sed -e "s|$work/front/|$work/cg-front/|g" -e "s|127.0.0.1:$peer_port|127.0.0.1:$cg_port|" \
        -e "s|127.0.0.1:$back_port|127.0.0.1:$cg_back|" \
        -e "s|master_process on|master_process off|" "$work/front/nginx.conf" >"$work/cg-front/nginx.conf"
      echo "==> starting the nginx chain under callgrind: 127.0.0.1:$cg_port → mTLS → 127.0.0.1:$cg_back"
      start_nginx_callgrind "$work/cg-back" "$cg_back"
      start_nginx_callgrind "$work/cg-front" "$cg_port"
      ;;
    vllm-router)
      # The comparison's router has done its part: one router at a time.
      stop_pid "${peer_pids[0]}"
      mkdir "$work/cg-vllm-router"
      echo "==> starting vllm-router under callgrind on 127.0.0.1:$cg_port (its Python start takes a while)"
      if start_vllm_router "$work/cg-vllm-router" "$cg_port" callgrind; then
        cg_pids+=("$vllm_router_pid")
      else
        echo "==> vllm-router did not run under callgrind: its instructions are not counted"
      fi
      ;;
  esac
  if [ "${#cg_pids[@]}" -gt 0 ]; then
    iargs+=(--mock-port "$mock_port" --peer "http://127.0.0.1:$cg_port" --peer-name "$peer")
    for pid in "${cg_pids[@]}"; do iargs+=(--peer-pid "$pid"); done
  fi
fi
echo "==> $bin/bench ${iargs[*]}"
"$bin/bench" "${iargs[@]}"
