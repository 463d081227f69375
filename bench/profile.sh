#!/usr/bin/env bash
# Where Palisade's CPU goes per tunnel and per DNS query, on the
# configuration ../shared/bench/palisade-put.sh gives it (org "bench" =
# loopback, allowed.bench by name, evidence on), behind a loopback nginx and
# dnsmasq, driven by the bench harness's loadgen:
#
#   sudo bench/profile.sh instructions [BIN...]   # default BIN: target/release/palisade
#   sudo bench/profile.sh perf [BIN]
#
# instructions: user-space instructions per CONNECT tunnel counted by
#   callgrind (for machines whose `perf stat` has no PMU to count them). For
#   each binary and concurrency (CONC, default "1 64"), runs Palisade under
#   `valgrind --tool=callgrind`, drives N1 and then N2 tunnels (CONNECT, GET
#   /small, close) and prints (I(N2) - I(N1)) / (tunnels(N2) - tunnels(N1)):
#   the start-up cost cancels out. Valgrind hides the CPU's SHA extensions,
#   so SHA-256 is counted in software. Bounded: N1=200, N2=1200 tunnels,
#   120 s per run at most.
# perf: `perf record` (software clock, call graphs) of Palisade pinned to
#   core 0 while loadgen on core 1 opens tunnels at concurrency 64 for 10 s,
#   then while dnsperf on core 1 asks the DNS shim for allowed.bench for
#   10 s; prints the split by object and the top symbols of each.
# Needs valgrind or perf, nginx (nginx-light), dnsmasq, dnsperf (perf mode),
# and the harness's loadgen (built by ../shared/bench/run-palisade.sh, or
# LOADGEN=path).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
  instructions | perf) shift ;;
  *) echo "usage: bench/profile.sh instructions|perf [BIN...]" >&2; exit 2 ;;
esac
N1=${N1:-200} N2=${N2:-1200} CONC=${CONC:-"1 64"}
LOADGEN=${LOADGEN:-../shared/bench/loadgen/target/release/loadgen}
[ "$#" -gt 0 ] || set -- target/release/palisade
tools=(nginx dnsmasq "$LOADGEN")
if [ "$mode" = instructions ]; then tools+=(valgrind); else tools+=(perf dnsperf taskset); fi
for b in "${tools[@]}"; do
  command -v "$b" >/dev/null || [ -x "$b" ] || { echo "missing: $b" >&2; exit 1; }
done
run=$(mktemp -d /tmp/palisade-profile.XXXXXX)
chmod 755 "$run" # dnsmasq and nginx workers drop root and must read their files
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
mkdir -p "$run/www" "$run/nginx" "$run/evidence"
printf 'x%.0s' $(seq 1 100) >"$run/www/small"
printf '127.0.0.1 allowed.bench\n' >"$run/hosts"
cat >"$run/nginx.conf" <<CONF
worker_processes 1;
daemon off;
pid $run/nginx.pid;
error_log $run/nginx-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $run/nginx;
  proxy_temp_path $run/nginx;
  fastcgi_temp_path $run/nginx;
  uwsgi_temp_path $run/nginx;
  scgi_temp_path $run/nginx;
  server {
    listen 127.0.0.1:18080;
    root $run/www;
    location = /small { default_type text/plain; }
  }
}
CONF
nginx -c "$run/nginx.conf" -p "$run/nginx" &
pids+=($!)
dnsmasq -k --port=15310 --listen-address=127.0.0.1 --bind-interfaces --no-resolv --no-hosts \
  --local-ttl=300 --addn-hosts="$run/hosts" --pid-file= >/dev/null 2>&1 &
pids+=($!)
cat >"$run/palisade.toml" <<CONF
[proxy]
listen = ["127.0.0.1:13140"]
max_new_connections_per_second_per_org = 100000000
[dns]
listen = ["127.0.0.1:15311"]
upstream = ["127.0.0.1:15310"]
max_queries_per_second_per_client = 100000000
max_queries_in_flight = 100000
[admin]
listen = "127.0.0.1:19719"
[evidence]
dir = "$run/evidence"
[[org]]
name = "bench"
clients = ["127.0.0.0/8"]
[[org.allow]]
host = "allowed.bench"
ports = [18080]
# loopback is always denied unless a cidr rule opens it (as palisade-put.sh does)
[[org.allow]]
cidr = "127.0.0.1/32"
ports = [18080]
CONF
wait_port() {
  for _ in $(seq 1 300); do
    (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.2
  done
  echo "nothing listens on $1" >&2
  return 1
}
wait_port 18080

# Prints "TUNNELS INSTRUCTIONS" for one run of N tunnels.
one() {
  local bin=$1 conc=$2 n=$3
  local out="$run/cg.$n"
  rm -rf "$run/evidence" "$run/evidence.key" "$out"*
  valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" run -c "$run/palisade.toml" \
    >"$run/palisade.log" 2>&1 &
  local p=$!
  wait_port 13140
  timeout 150 "$LOADGEN" tunnel-rate --proxy 127.0.0.1:13140 --host allowed.bench:18080 \
    --path /small --concurrency "$conc" --max-requests "$n" --duration 120 --warmup 0 \
    --op-timeout 30 >"$run/loadgen.$n"
  kill -TERM "$p"
  wait "$p" || true
  local ok ir
  ok=$(grep -o '"ok":[0-9]*' "$run/loadgen.$n" | head -n1 | cut -d: -f2)
  ir=$(grep -h '^summary:' "$out"* | awk '{ s += $2 } END { print s }')
  if [ "${ok:-0}" -eq 0 ]; then
    echo "no tunnel succeeded: $(cat "$run/loadgen.$n")" >&2
    exit 1
  fi
  echo "$ok $ir"
}

# Prints the split by object and the top symbols of a perf data file.
top() {
  # head closes the pipe early: not a failure
  perf report -i "$1" --no-children --sort dso -g none 2>/dev/null | grep '%' | head -n 5 || true
  perf report -i "$1" --no-children --sort sym -g none 2>/dev/null | grep '%' | head -n 20 || true
}

if [ "$mode" = perf ]; then
  bin=$1
  rm -rf "$run/evidence" "$run/evidence.key"
  taskset -c 0 "$bin" run -c "$run/palisade.toml" >"$run/palisade.log" 2>&1 &
  p=$!
  pids+=("$p")
  wait_port 13140
  taskset -c 1 timeout 30 "$LOADGEN" tunnel-rate --proxy 127.0.0.1:13140 \
    --host allowed.bench:18080 --path /small --concurrency 64 --duration 10 --warmup 0 \
    >"$run/loadgen.perf" &
  lg=$!
  sleep 2
  perf record -F 999 -g -o "$run/tunnel.data" -p "$p" -- sleep 6 >/dev/null 2>&1
  wait "$lg"
  echo "== tunnels, c=64: $(grep -o '"rate_per_s":[0-9.]*' "$run/loadgen.perf")"
  top "$run/tunnel.data"
  echo "allowed.bench A" >"$run/queries"
  taskset -c 1 timeout 30 dnsperf -s 127.0.0.1 -p 15311 -d "$run/queries" -l 10 -c 4 -q 200 \
    >"$run/dnsperf.txt" 2>&1 &
  dp=$!
  sleep 2
  perf record -F 999 -g -o "$run/dns.data" -p "$p" -- sleep 6 >/dev/null 2>&1
  wait "$dp"
  echo "== DNS, cached allowed name: $(grep 'Queries per second' "$run/dnsperf.txt")"
  top "$run/dns.data"
  echo "perf data: $run/tunnel.data, $run/dns.data"
  exit 0
fi

for bin in "$@"; do
  for conc in $CONC; do
    r1=$(one "$bin" "$conc" "$N1") || exit 1
    r2=$(one "$bin" "$conc" "$N2") || exit 1
    read -r t1 i1 <<<"$r1"
    read -r t2 i2 <<<"$r2"
    echo "$bin c=$conc: $(( (i2 - i1) / (t2 - t1) )) instructions per tunnel ($t1 and $t2 tunnels)"
  done
done
echo "callgrind files (last binary and concurrency): $run (callgrind_annotate $run/cg.$N2)"
