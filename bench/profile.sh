#!/usr/bin/env bash
# Where Palisade's CPU goes per tunnel and per DNS query, on the
# configuration ../shared/bench/palisade-put.sh gives it (org "bench" =
# loopback, allowed.bench by name, evidence on), behind a loopback nginx and
# dnsmasq, driven by the bench harness's loadgen:
#
#   sudo bench/profile.sh instructions [BIN...]   # default BIN: target/release/palisade
#   sudo bench/profile.sh perf [BIN]
#   sudo bench/profile.sh syscalls [BIN]
#   sudo bench/profile.sh split [BIN]
#
# instructions: user-space instructions per CONNECT tunnel counted by
#   callgrind (for machines whose `perf stat` has no PMU to count them). For
#   each binary and concurrency (CONC, default "1 64"), runs Palisade under
#   `valgrind --tool=callgrind`, drives N1 and then N2 tunnels (CONNECT, GET
#   /small, close) and prints (I(N2) - I(N1)) / (tunnels(N2) - tunnels(N1)):
#   the start-up cost cancels out. Valgrind hides the CPU's SHA extensions,
#   so SHA-256 is counted in software: each line also gives the count
#   outside SHA-256. Then the same for cached DNS queries for allowed.bench
#   at one in flight (DNS_N1=2000, DNS_N2=12000 queries), and for
#   absolute-form GETs over kept-alive connections at concurrency 64
#   (KA_N1=1000, KA_N2=6000 requests). WORK="tunnels dns keepalive" (the
#   default) picks the workloads. Bounded: N1=200, N2=1200 tunnels, 120 s
#   per run at most.
# perf: `perf record` (software clock, call graphs) of Palisade pinned to
#   core 0 while loadgen on core 1 opens tunnels at concurrency 64 for 10 s,
#   then while dnsperf on core 1 asks the DNS shim for allowed.bench for
#   10 s; prints the split by object and the top symbols of each.
# syscalls: system calls and context switches per unit of work, for
#   Palisade and, beside it, for the floor of the same work: HAProxy as a bare
#   TCP relay (tunnels and keep-alive GETs: the same GET /small, relayed
#   without CONNECT, policy or log) and dnsmasq as a caching DNS filter
#   (queries). Per workload, `perf trace -s` is attached to the warmed-up
#   server for N1 and then N2 units (SYS_N1=2000, SYS_N2=6000 by default) and
#   (count(N2) - count(N1)) / (N2 - N1) is printed per syscall: start-up, the
#   attach and idle timers cancel out. Wake-ups (voluntary context switches) are read from
#   /proc/PID/task/*/status the same way. Workloads: new tunnel + GET + close
#   at c=1 (server, loadgen and nginx on one core, as the harness places
#   them) and c=64 (server on its own core), keep-alive absolute-form GETs at
#   c=64, and UDP queries for a cached allowed name at c=1 and c=64 (the
#   loadgen on the other core). SYS_ONLY=TEXT
#   keeps only the workloads whose label contains TEXT (e.g. "DNS").
# split: the CPU per unit split by where it is spent (user space by object,
#   the kernel by system call, the switch when preempted; bench/perf-split.py),
#   for Palisade beside the floor of the same work, in microseconds per unit:
#   new tunnel + GET + close at c=64 (each server alone on core 0) and at
#   c=1 (server, loadgen and nginx on core 1), beside HAProxy as a bare
#   relay; cached DNS queries at c=1 (all on core 1) beside dnsmasq. Each
#   server runs SPLIT_DUR seconds (default 8) under load; `perf record -g`
#   samples it from the 2nd second for SPLIT_DUR - 4 seconds; the loadgen
#   measures its CPU per unit over the whole run.
# Needs valgrind or perf, nginx (nginx-light), dnsmasq, dnsperf (perf mode),
# and the harness's loadgen (built by ../shared/bench/run-palisade.sh, or
# LOADGEN=path).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
  instructions | perf | syscalls | split) shift ;;
  *) echo "usage: bench/profile.sh instructions|perf|syscalls|split [BIN...]" >&2; exit 2 ;;
esac
N1=${N1:-200} N2=${N2:-1200} CONC=${CONC:-"1 64"}
LOADGEN=${LOADGEN:-../shared/bench/loadgen/target/release/loadgen}
[ "$#" -gt 0 ] || set -- target/release/palisade
tools=(nginx dnsmasq "$LOADGEN")
case "$mode" in
  instructions) tools+=(valgrind callgrind_annotate dig) ;;
  perf) tools+=(perf dnsperf taskset) ;;
  syscalls) tools+=(perf taskset haproxy) ;;
  split) tools+=(perf taskset haproxy python3) ;;
esac
for b in "${tools[@]}"; do
  command -v "$b" >/dev/null || [ -x "$b" ] || { echo "missing: $b" >&2; exit 1; }
done
run=$(mktemp -d /tmp/palisade-profile.XXXXXX)
chmod 755 "$run" # dnsmasq and nginx workers drop root and must read their files
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
. bench/floors.sh
mkdir -p "$run/evidence"
origin_files "$run"
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
wait_port 18080

# Prints "UNITS INSTRUCTIONS SHA256_INSTRUCTIONS" for one run of N units:
# tunnels at concurrency CONC, or (CONC "dns") cached DNS queries at one in
# flight, or (CONC "ka") kept-alive absolute-form GETs at concurrency 64.
one() {
  local bin=$1 conc=$2 n=$3
  local out="$run/cg.$n"
  rm -rf "$run/evidence" "$run/evidence.key" "$out"*
  valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" run -c "$run/palisade.toml" \
    >"$run/palisade.log" 2>&1 &
  local p=$!
  wait_port 13140
  if [ "$conc" = dns ]; then
    # the shim answers once the proxy listens; the first answer fills its cache
    for _ in $(seq 1 50); do
      dig +short +time=2 +tries=1 -p 15311 @127.0.0.1 allowed.bench A | grep -qx '127\.0\.0\.1' && break
      sleep 0.5
    done
    timeout 150 "$LOADGEN" dns-rate --server 127.0.0.1:15311 --qname allowed.bench \
      --concurrency 1 --max-requests "$n" --duration 120 --warmup 0 --op-timeout 30 \
      >"$run/loadgen.$n"
  elif [ "$conc" = ka ]; then
    timeout 150 "$LOADGEN" forward-rate --proxy 127.0.0.1:13140 --host allowed.bench:18080 \
      --path /small --concurrency 64 --keepalive on --max-requests "$n" --duration 120 \
      --warmup 0 --op-timeout 30 >"$run/loadgen.$n"
  else
    timeout 150 "$LOADGEN" tunnel-rate --proxy 127.0.0.1:13140 --host allowed.bench:18080 \
      --path /small --concurrency "$conc" --max-requests "$n" --duration 120 --warmup 0 \
      --op-timeout 30 >"$run/loadgen.$n"
  fi
  kill -TERM "$p"
  wait "$p" || true
  local ok ir sha
  ok=$(grep -o '"ok":[0-9]*' "$run/loadgen.$n" | head -n1 | cut -d: -f2)
  ir=$(grep -h '^summary:' "$out"* | awk '{ s += $2 } END { print s }')
  sha=$(callgrind_annotate --auto=no --threshold=100 "$out"* 2>/dev/null |
    awk '/sha2::sha256::compress256/ { gsub(",", "", $1); s += $1 } END { print s + 0 }')
  if [ "${ok:-0}" -eq 0 ]; then
    echo "no unit succeeded: $(cat "$run/loadgen.$n")" >&2
    exit 1
  fi
  echo "$ok $ir $sha"
}

# Prints the split by object and the top symbols of a perf data file.
top() {
  # head closes the pipe early: not a failure
  perf report -i "$1" --no-children --sort dso -g none 2>/dev/null | grep '%' | head -n 5 || true
  perf report -i "$1" --no-children --sort sym -g none 2>/dev/null | grep '%' | head -n 20 || true
}

# The voluntary context switches (wake-ups after blocking) of every thread of PID;
# involuntary ones count other jobs preempting it, not its own work.
switches() {
  cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^voluntary_ctxt_switches/ { s += $2 } END { print s + 0 }'
}

# Runs `perf trace -s` on PID while CMD... runs; prints "SYSCALL CALLS" lines
# summed over threads, then "ctxt_switches N" and "ok N" (CMD's JSON "ok").
traced() {
  local pid=$1 out=$2
  shift 2
  local c0 c1
  c0=$(switches "$pid")
  perf trace -s -p "$pid" -o "$out.trace" -- "$@" >"$out.json" 2>"$out.err"
  c1=$(switches "$pid")
  awk '$1 ~ /^[a-z_0-9]+$/ && $2 ~ /^[0-9]+$/ && $3 ~ /^[0-9]+$/ && NF >= 8 { n[$1] += $2 }
       END { for (k in n) print k, n[k] }' "$out.trace"
  echo "ctxt_switches $((c1 - c0))"
  echo "ok $(grep -o '"ok":[0-9]*' "$out.json" | head -n1 | cut -d: -f2)"
}

# Prints, for one workload, the per-unit difference of two traced runs of N1
# and N2 units: "SYSCALL PER_UNIT" sorted by count, the total, switches.
per_unit() {
  local pid=$1 label=$2 cpu=$3
  shift 3
  case "$label" in *"${SYS_ONLY:-}"*) ;; *) return 0 ;; esac
  local a="$run/sys.$label.1" b="$run/sys.$label.2"
  local lg=(taskset -c "$cpu" timeout 150 "$LOADGEN" "$@" --duration 120 --warmup 0 --op-timeout 30)
  traced "$pid" "$a" "${lg[@]}" --max-requests "$SYS_N1" >"$a.counts"
  traced "$pid" "$b" "${lg[@]}" --max-requests "$SYS_N2" >"$b.counts"
  awk -v label="$label" '
    FNR == 1 { f++ }
    f == 1 { a[$1] = $2; keys[$1] = 1 }
    f == 2 { b[$1] = $2; keys[$1] = 1 }
    END {
      units = b["ok"] - a["ok"]
      if (units <= 0) { print label ": no units completed" > "/dev/stderr"; exit 1 }
      total = 0
      for (k in keys) {
        if (k == "ok" || k == "ctxt_switches") continue
        d = (b[k] - a[k]) / units
        if (d >= 0.05) { line[k] = d; total += d }
      }
      printf "== %s: %.1f syscalls and %.2f wake-ups (voluntary context switches) per unit (%d units)\n", label, total, (b["ctxt_switches"] - a["ctxt_switches"]) / units, units
      cmd = "sort -k2 -nr"
      for (k in line) printf "   %-20s %6.2f\n", k, line[k] | cmd
      close(cmd)
    }' "$a.counts" "$b.counts"
}

# start_with_floors BIN: Palisade (PID in p) and, beside it, the floors of
# the same work: HAProxy as a bare relay to nginx on port 13150 (h) and
# dnsmasq as a caching DNS filter on port 15312 (dm). Started on one core,
# as the harness starts them: a runtime sized from its CPU affinity has
# one worker then.
start_with_floors() {
  relay_cfg "$run/haproxy.cfg"
  taskset -c 1 dnsmasq -k --port=15312 --listen-address=127.0.0.1 --bind-interfaces --no-resolv \
    --no-hosts --server=127.0.0.1#15310 --cache-size=1000 --pid-file= >/dev/null 2>&1 &
  dm=$!
  pids+=("$dm")
  rm -rf "$run/evidence" "$run/evidence.key"
  taskset -c 1 "$1" run -c "$run/palisade.toml" >"$run/palisade.log" 2>&1 &
  p=$!
  pids+=("$p")
  taskset -c 1 haproxy -db -f "$run/haproxy.cfg" >"$run/haproxy.log" 2>&1 &
  h=$!
  pids+=("$h")
  wait_port 13140
  wait_port 13150
}

if [ "$mode" = syscalls ]; then
  bin=$1
  SYS_N1=${SYS_N1:-2000} SYS_N2=${SYS_N2:-6000}
  warm() { timeout 150 "$LOADGEN" "$@" --duration 120 --warmup 0 --op-timeout 30 --max-requests 500 >/dev/null; }
  start_with_floors "$bin"
  tun=(tunnel-rate --proxy 127.0.0.1:13140 --host allowed.bench:18080 --path /small)
  rel=(direct-rate --backend 127.0.0.1:13150 --host allowed.bench:18080 --path /small)
  fwd=(forward-rate --proxy 127.0.0.1:13140 --host allowed.bench:18080 --path /small --keepalive on)
  dns=(dns-rate --qname allowed.bench --concurrency 1)
  # c=1: everything on core 1; otherwise the server alone on core 0
  warm "${tun[@]}" --concurrency 1; warm "${rel[@]}" --concurrency 1
  per_unit "$p" "palisade: tunnel c=1" 1 "${tun[@]}" --concurrency 1
  per_unit "$h" "relay: connection c=1" 1 "${rel[@]}" --concurrency 1 --keepalive off
  warm "${dns[@]}" --server 127.0.0.1:15311; warm "${dns[@]}" --server 127.0.0.1:15312
  per_unit "$p" "palisade: DNS query c=1" 1 "${dns[@]}" --server 127.0.0.1:15311
  per_unit "$dm" "dnsmasq: DNS query c=1" 1 "${dns[@]}" --server 127.0.0.1:15312
  # Many in flight, as dnsperf keeps them: the shim takes them in rounds.
  per_unit "$p" "palisade: DNS query c=64" 0 "${dns[@]/%1/64}" --server 127.0.0.1:15311
  per_unit "$dm" "dnsmasq: DNS query c=64" 0 "${dns[@]/%1/64}" --server 127.0.0.1:15312
  taskset -apc 0 "$p" >/dev/null; taskset -pc 0 "$h" >/dev/null
  per_unit "$p" "palisade: tunnel c=64" 1 "${tun[@]}" --concurrency 64
  per_unit "$h" "relay: connection c=64" 1 "${rel[@]}" --concurrency 64 --keepalive off
  per_unit "$p" "palisade: keep-alive GET c=64" 1 "${fwd[@]}" --concurrency 64
  per_unit "$h" "relay: keep-alive GET c=64" 1 "${rel[@]}" --concurrency 64 --keepalive on
  exit 0
fi

if [ "$mode" = split ]; then
  bin=$1
  dur=${SPLIT_DUR:-8}
  [ "$dur" -ge 6 ] || { echo "SPLIT_DUR must be 6 or more" >&2; exit 2; }
  start_with_floors "$bin"
  # sampled NAME PID CPU LOADGEN-ARGS...: one loaded run of PID, sampled
  # in its middle; writes $run/split.NAME.txt and prints the CPU per unit.
  sampled() {
    local name=$1 pid=$2 cpu=$3
    shift 3
    taskset -c "$cpu" timeout $((dur + 60)) "$LOADGEN" "$@" --duration "$dur" --warmup 0.5 \
      --op-timeout 10 --cpu-pid "$pid" >"$run/split.$name.json" &
    local lg=$!
    sleep 2
    perf record -q -g -F 2000 -o "$run/split.$name.data" -p "$pid" -- sleep $((dur - 4)) \
      >/dev/null 2>&1
    wait "$lg"
    perf script -i "$run/split.$name.data" >"$run/split.$name.txt" 2>/dev/null
    python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(j["proxy_cpu_s"] * 1e6 / max(j["ok"], 1))' \
      "$run/split.$name.json"
  }
  tun=(tunnel-rate --proxy 127.0.0.1:13140 --host allowed.bench:18080 --path /small)
  rel=(direct-rate --backend 127.0.0.1:13150 --host allowed.bench:18080 --path /small --keepalive off)
  dns=(dns-rate --qname allowed.bench --concurrency 1)
  a=$(sampled dns-palisade "$p" 1 "${dns[@]}" --server 127.0.0.1:15311)
  b=$(sampled dns-dnsmasq "$dm" 1 "${dns[@]}" --server 127.0.0.1:15312)
  echo "== cached DNS query, c=1 (server, loadgen on core 1)"
  python3 bench/perf-split.py "palisade=$run/split.dns-palisade.txt:$a" "dnsmasq=$run/split.dns-dnsmasq.txt:$b"
  a=$(sampled t1-palisade "$p" 1 "${tun[@]}" --concurrency 1)
  b=$(sampled t1-relay "$h" 1 "${rel[@]}" --concurrency 1)
  echo "== new tunnel + GET + close, c=1 (server, loadgen and nginx on core 1)"
  python3 bench/perf-split.py "palisade=$run/split.t1-palisade.txt:$a" "relay=$run/split.t1-relay.txt:$b"
  taskset -apc 0 "$p" >/dev/null
  taskset -pc 0 "$h" >/dev/null
  a=$(sampled t64-palisade "$p" 1 "${tun[@]}" --concurrency 64)
  b=$(sampled t64-relay "$h" 1 "${rel[@]}" --concurrency 64)
  echo "== new tunnel + GET + close, c=64 (server alone on core 0)"
  python3 bench/perf-split.py "palisade=$run/split.t64-palisade.txt:$a" "relay=$run/split.t64-relay.txt:$b"
  exit 0
fi

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

WORK=${WORK:-"tunnels dns keepalive"} DNS_N1=${DNS_N1:-2000} DNS_N2=${DNS_N2:-12000}
KA_N1=${KA_N1:-1000} KA_N2=${KA_N2:-6000}
# per_unit BIN CONC N1 N2 WHAT: the line for one workload
per_unit() {
  local r1 r2 t1 i1 s1 t2 i2 s2
  r1=$(one "$1" "$2" "$3") || exit 1
  r2=$(one "$1" "$2" "$4") || exit 1
  read -r t1 i1 s1 <<<"$r1"
  read -r t2 i2 s2 <<<"$r2"
  echo "$1 $5: $(( (i2 - i1) / (t2 - t1) )) instructions per unit," \
    "$(( (i2 - i1 - s2 + s1) / (t2 - t1) )) outside SHA-256 ($t1 and $t2 units)"
}
for bin in "$@"; do
  case " $WORK " in *" tunnels "*)
    for conc in $CONC; do per_unit "$bin" "$conc" "$N1" "$N2" "tunnels c=$conc"; done ;;
  esac
  case " $WORK " in *" dns "*) per_unit "$bin" dns "$DNS_N1" "$DNS_N2" "cached DNS queries c=1" ;; esac
  case " $WORK " in *" keepalive "*)
    per_unit "$bin" ka "$KA_N1" "$KA_N2" "kept-alive forwarded GETs c=64" ;;
  esac
done
echo "callgrind files (the last run): $run"
