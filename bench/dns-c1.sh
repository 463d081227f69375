#!/usr/bin/env bash
# CPU per cached DNS query at one query in flight, as the harness's
# `dns_c1` figure measures it, for one or two Palisade builds beside
# dnsmasq, alternating, in one run:
#
#   sudo bench/dns-c1.sh BIN_A[:EXTRA] [BIN_B[:EXTRA]] [ROUNDS]
#
# dnsmasq (upstream: allowed.bench -> 127.0.0.1, TTL 3600; filter: a cache
# in front of it) and each build listen on loopback. Each build is
# configured as the harness's palisade-put.sh configures it: evidence on,
# allowed.bench allowed by name and 127.0.0.1 by a cidr rule (without it
# the loopback address is filtered out of the answer). The harness's
# loadgen asks allowed.bench at concurrency 1 for DUR seconds (default 5)
# per run, everything on CPU 1 as the harness places its c=1 runs. Per run: the server's CPU (user + system, from
# /proc) divided by the answers, the load generator's own CPU per answer
# beside it, and the server's context switches per answer (slept,
# preempted). Prints each run and the medians, with the ratios to dnsmasq
# and B/A. EVROOT=DIR puts the evidence there (default:
# the run's temporary directory). EXTRA is a file of lines added to that
# build's `[evidence]` section (e.g. `durability = "discard"`), so one
# binary can be measured in two configurations. FLOOD=SECONDS runs, before
# each server's c=1 run, `dnsperf` against it for that long (200 queries
# in flight, the server moved to CPU 0 meanwhile), as the harness floods
# each server just before its c=1 runs. Needs dnsmasq, dig, taskset,
# python3 (and dnsperf with FLOOD) and the loadgen (built by
# ../shared/bench/run-palisade.sh, or LOADGEN=path).
set -euo pipefail
cd "$(dirname "$0")/.."
A=${1:?usage: bench/dns-c1.sh BIN_A [BIN_B] [ROUNDS]}
B=${2:-}
ROUNDS=${3:-3}
DUR=${DUR:-5}
FLOOD=${FLOOD:-0}
LOADGEN=${LOADGEN:-../shared/bench/loadgen/target/release/loadgen}
tools=(dnsmasq dig taskset python3 "$LOADGEN")
if [ "$FLOOD" != 0 ]; then tools+=(dnsperf); fi
for t in "${tools[@]}"; do
  command -v "$t" >/dev/null || [ -x "$t" ] || { echo "missing: $t" >&2; exit 1; }
done
run=$(mktemp -d /tmp/palisade-dns-c1.XXXXXX)
chmod 755 "$run" # dnsmasq drops root and reads its files
ev=${EVROOT:-$run}
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$run" "$ev/a-ev" "$ev/b-ev"
}
trap cleanup EXIT

cat >"$run/up.conf" <<CONF
port=15400
listen-address=127.0.0.1
bind-interfaces
no-resolv
no-hosts
no-negcache
cache-size=0
local-ttl=3600
local=/bench/
host-record=allowed.bench,127.0.0.1
CONF
cat >"$run/filter.conf" <<CONF
port=15401
listen-address=127.0.0.1
bind-interfaces
no-resolv
no-hosts
server=/allowed.bench/127.0.0.1#15400
address=/#/
CONF
taskset -c 1 dnsmasq -k --conf-file="$run/up.conf" --pid-file= &
pids+=($!)
taskset -c 1 dnsmasq -k --conf-file="$run/filter.conf" --pid-file= &
filter=$!
pids+=("$filter")

# start NAME BIN[:EXTRA] DNS_PORT: a build on its own ports and evidence
# (its pid in $started)
start() {
  local port=$3 bin=${2%%:*} extra=
  if [ "$2" != "$bin" ]; then extra=${2#*:}; fi
  cat >"$run/$1.toml" <<CONF
[proxy]
listen = ["127.0.0.1:$((port + 100))"]
[dns]
listen = ["127.0.0.1:$port"]
upstream = ["127.0.0.1:15400"]
max_queries_per_second_per_client = 100000000
max_queries_in_flight = 100000
[admin]
listen = "127.0.0.1:$((port + 200))"
[evidence]
dir = "$ev/$1-ev"
$(if [ -n "$extra" ]; then cat "$extra"; fi)
[[org]]
name = "bench"
clients = ["127.0.0.0/8"]
[[org.allow]]
host = "allowed.bench"
ports = [80, 443, 8080]
[[org.allow]]
cidr = "127.0.0.1/32"
ports = [80, 443, 8080]
CONF
  taskset -c 1 "$bin" run -c "$run/$1.toml" >"$run/$1.log" 2>&1 &
  started=$!
  pids+=("$started")
}
servers="dnsmasq:15401:$filter"
start a "$A" 15402
servers="$servers A:15402:$started"
if [ -n "$B" ]; then
  start b "$B" 15403
  servers="$servers B:15403:$started"
fi
# Every server answers allowed.bench before the runs, or the bench stops
# with what the server said.
for s in $servers; do
  IFS=: read -r name port _ <<<"$s"
  answered=
  for _ in $(seq 1 50); do
    answered=$(dig +short +time=1 +tries=1 -p "$port" @127.0.0.1 allowed.bench A |
      grep -x '127\.0\.0\.1' || true)
    [ -n "$answered" ] && break
    sleep 0.2
  done
  if [ -z "$answered" ]; then
    echo "$name on port $port never answered allowed.bench" >&2
    tail -n 20 "$run"/*.log >&2 || true
    exit 1
  fi
done

echo "allowed.bench A" >"$run/queries"
# switches PID: the server's voluntary (it slept) and involuntary (it was
# preempted) context switches so far, all its threads.
switches() {
  cat /proc/"$1"/task/*/status 2>/dev/null |
    awk '/^voluntary_ctxt_switches/ {v += $2} /^nonvoluntary_ctxt_switches/ {n += $2}
         END {print v + 0, n + 0}'
}
for r in $(seq 1 "$ROUNDS"); do
  for s in $servers; do
    IFS=: read -r name port pid <<<"$s"
    if [ "$FLOOD" != 0 ]; then
      taskset -apc 0 "$pid" >/dev/null
      taskset -c 1 timeout $((FLOOD + 30)) dnsperf -s 127.0.0.1 -p "$port" -d "$run/queries" \
        -l "$FLOOD" -c 4 -q 200 >/dev/null 2>&1 || true
      taskset -apc 1 "$pid" >/dev/null
    fi
    switches0=$(switches "$pid")
    taskset -c 1 timeout $((DUR + 30)) "$LOADGEN" dns-rate --server "127.0.0.1:$port" \
      --qname allowed.bench --concurrency 1 --duration "$DUR" --warmup 0.5 \
      --cpu-pid "$pid" --op-timeout 2 --label "$name" >"$run/out.json"
    switches1=$(switches "$pid")
    python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
ok = max(j["ok"], 1)
client = j["loadgen_cpu_util"] * j["duration_s"] * 1e6 / ok
(v0, n0), (v1, n1) = (map(int, a.split()) for a in sys.argv[2:4])
print(j["label"], round(j["proxy_cpu_s"] * 1e6 / ok, 3), j["ok"], round(client, 3),
      round((v1 - v0) / ok, 3), round((n1 - n0) / ok, 3))
' "$run/out.json" "$switches0" "$switches1"
  done
done | tee "$run/runs"
python3 - "$run/runs" <<'PY'
import collections, statistics, sys
v, c = collections.defaultdict(list), collections.defaultdict(list)
sw = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, us, _, client, slept, preempted = line.split()
    v[name].append(float(us))
    c[name].append(float(client))
    sw[name].append((float(slept), float(preempted)))
m = {k: statistics.median(x) for k, x in v.items()}
print("median µs/query:", {k: round(x, 2) for k, x in m.items()})
# The load generator's own CPU per query beside each server: the same
# work, so what differs is what sharing the core with that server costs it.
print("median client µs/query beside each:",
      {k: round(statistics.median(x), 2) for k, x in c.items()})
# How the server leaves the core per query: asleep (voluntary) or
# preempted (involuntary). Counted over the warm-up too: up to a tenth high.
print("median server switches/query (slept, preempted):",
      {k: tuple(round(statistics.median(s[i] for s in x), 3) for i in (0, 1))
       for k, x in sw.items()})
for k in ("A", "B"):
    if k in m:
        print(f"{k}/dnsmasq {m[k] / m['dnsmasq']:.3f}")
if "B" in m:
    print(f"B/A {m['B'] / m['A']:.3f}")
PY
