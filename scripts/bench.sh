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
#                                    of the mock (arm C), when nginx is installed: its
#                                    latency, the CPU and memory of its master and worker
#                                    processes, and IOP ÷ nginx against the relay's goals
#   scripts/bench.sh --cores-scaling instead of the comparison, run `bench cores`: bulk relay
#                                    throughput (body bytes/s of 256 x 4 KiB-token streams,
#                                    32 concurrent) with edge-bin and node-bin on --cores 0
#                                    vs --cores 0-1, against a direct baseline, in alternating
#                                    rounds; prints the ratio and writes
#                                    bench/results/cores-<unix-ts>.json (about 2 minutes;
#                                    --quick: about 30 s)
#   scripts/bench.sh --bin-dir DIR   measure the binaries in DIR (an older build, say)
#                                    instead of building target/release
#   scripts/bench.sh --swarm         instead of the comparison, run `bench swarm`: one Edge and
#                                    10, 100 and 1,000 simulated Nodes (each its own mTLS
#                                    connection and certificate) in one process: Edge RSS per
#                                    node, cold start and SIGKILL + restart recovery (jitter on
#                                    and off), dispatch latency, heartbeat CPU, Control's
#                                    decision costs; writes bench/results/swarm-<unix-ts>.json
#                                    (about 3 minutes; --quick: about 40 s)
#   scripts/bench.sh -- ARGS...      pass ARGS on to `bench compare` (or `bench cores` with
#                                    --cores-scaling, `bench swarm` with --swarm; see
#                                    `bench compare --help`)
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
peer_nginx=0
cores_scaling=0
swarm=0
extra=()
bin_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) shift; bin_dir=$(cd "${1:?--bin-dir needs a directory}" && pwd) ;;
    --quick) quick=1 ;;
    --peer-nginx) peer_nginx=1 ;;
    --cores-scaling) cores_scaling=1 ;;
    --swarm) swarm=1 ;;
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

if [ "$swarm" = 1 ]; then
  if [ "$peer_nginx" = 1 ] || [ "$cores_scaling" = 1 ]; then
    echo "--swarm runs on its own: drop --peer-nginx and --cores-scaling" >&2
    exit 2
  fi
  # One socket per node in the harness and in the Edge: raise the soft
  # open-file limit to the hard one (bench swarm does too, and says so).
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
  args=(swarm --bin-dir "$bin" --out bench/results)
  if [ "$quick" = 1 ]; then args+=(--quick); fi
  echo "==> $bin/bench ${args[*]} ${extra[*]}"
  exec "$bin/bench" "${args[@]}" "${extra[@]}"
fi

if [ "$cores_scaling" = 1 ]; then
  if [ "$peer_nginx" = 1 ]; then
    echo "--peer-nginx applies to the comparison, not to --cores-scaling" >&2
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
nginx_pid=""
cleanup() {
  trap - EXIT
  if [ -n "$nginx_pid" ]; then
    kill -TERM "$nginx_pid" 2>/dev/null || true
    wait "$nginx_pid" 2>/dev/null || true
  fi
  if [ -n "$work" ]; then rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

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

if [ "$peer_nginx" = 1 ]; then
  if command -v nginx >/dev/null 2>&1; then
    work=$(mktemp -d -t iop-bench-nginx.XXXXXX)
    chmod 755 "$work"
    mock_port=$(free_port)
    nginx_port=$(free_port "$mock_port")
    cat >"$work/nginx.conf" <<NGINX
daemon off;
master_process on;
worker_processes 1;
pid $work/nginx.pid;
error_log $work/error.log warn;
events { worker_connections 16384; }
http {
  access_log off;
  client_body_temp_path $work/client_body;
  proxy_temp_path $work/proxy;
  fastcgi_temp_path $work/fastcgi;
  uwsgi_temp_path $work/uwsgi;
  scgi_temp_path $work/scgi;
  upstream iop_mock {
    server 127.0.0.1:$mock_port;
    keepalive 256;
  }
  server {
    listen 127.0.0.1:$nginx_port;
    location / {
      proxy_pass http://iop_mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
NGINX
    echo "==> starting nginx on 127.0.0.1:$nginx_port in front of the mock at 127.0.0.1:$mock_port"
    nginx -p "$work" -c "$work/nginx.conf" -e "$work/error.log" &
    nginx_pid=$!
    for _ in $(seq 1 100); do
      listening "$nginx_port" && break
      kill -0 "$nginx_pid" 2>/dev/null || { echo "nginx exited:" >&2; cat "$work/error.log" >&2; exit 1; }
      sleep 0.05
    done
    # Sample nginx's master and its workers (its children; the master may
    # listen before it forks them): bench compare sums their CPU and memory.
    peer_pids=("$nginx_pid")
    if command -v pgrep >/dev/null 2>&1; then
      for _ in $(seq 1 40); do
        workers=$(pgrep -P "$nginx_pid" || true)
        [ -n "$workers" ] && break
        sleep 0.05
      done
      for pid in $workers; do peer_pids+=("$pid"); done
    fi
    if [ "${#peer_pids[@]}" -lt 2 ]; then
      echo "==> nginx's worker processes not found (no pgrep?): sampling the master only" >&2
    fi
    args+=(--mock-port "$mock_port" --peer "http://127.0.0.1:$nginx_port" --peer-name nginx)
    for pid in "${peer_pids[@]}"; do args+=(--peer-pid "$pid"); done
  else
    echo "==> nginx is not installed (not on PATH): running without the nginx peer (arm C)"
  fi
fi

echo "==> $bin/bench ${args[*]} ${extra[*]}"
"$bin/bench" "${args[@]}" "${extra[@]}"
