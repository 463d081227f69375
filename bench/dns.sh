#!/usr/bin/env bash
# DNS shim throughput against dnsmasq configured the same way, in one run.
#
#   cargo build --release && sudo bench/dns.sh [SECONDS]
#
# Needs root, iproute2, python3, dnsperf and dnsmasq (Debian: apt-get install
# dnsperf dnsmasq-base). Builds three network namespaces on 198.18.0.0/15
# (client, server, upstream; no link to the root namespace), runs the test
# upstream (tests/fixtures/dns.py), Palisade's shim on 198.18.1.1:53 and
# dnsmasq on 198.18.1.1:5300, both allowing only allowed.test and forwarding
# it to the upstream with a cache; every other name is refused (Palisade:
# REFUSED + EDE and an evidence record; dnsmasq: NXDOMAIN, local). Each
# dnsperf run is bounded by -l SECONDS. With two cores or more, both servers
# are pinned to core 1 and dnsperf to core 0. Server CPU per query is taken
# from /proc/PID/stat (user + system) around each run. With DNS_MD=FILE a
# markdown table is written there too. Everything is removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${1:-10}"
BIN="${PALISADE_BIN:-target/release/palisade}"
ID="plbench-$$"
C="$ID-c" S="$ID-s" U="$ID-u"
WORK="$(mktemp -d)"

cleanup() {
  for ns in "$C" "$S" "$U"; do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill $pids 2>/dev/null || true
  done
  sleep 0.3
  for ns in "$C" "$S" "$U"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

for ns in "$C" "$S" "$U"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip -n "$S" link add s0 type veth peer name c0 netns "$C"
ip -n "$S" link add s1 type veth peer name u0 netns "$U"
ip -n "$C" addr add 198.18.1.2/24 dev c0
ip -n "$S" addr add 198.18.1.1/24 dev s0
ip -n "$S" addr add 198.18.2.1/24 dev s1
ip -n "$U" addr add 198.18.2.2/24 dev u0
for l in "$C c0" "$S s0" "$S s1" "$U u0"; do set -- $l; ip -n "$1" link set "$2" up; done

ip netns exec "$U" python3 tests/fixtures/dns.py serve --listen 198.18.2.2 --port 53 \
  --log "$WORK/upstream.jsonl" --ready "$WORK/up.ready" --a allowed.test=198.18.2.10 &
for _ in $(seq 50); do [ -f "$WORK/up.ready" ] && break; sleep 0.1; done

cat > "$WORK/palisade.toml" <<EOF
[proxy]
listen = []
[dns]
listen = ["198.18.1.1:53"]
upstream = ["198.18.2.2:53"]
max_queries_per_second_per_client = 10000000
max_queries_in_flight = 4096
[admin]
listen = "198.18.1.1:9711"
[evidence]
dir = "$WORK/evidence"
[[org]]
name = "bench"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
EOF
PIN_SERVER=() PIN_CLIENT=()
if [ "$(nproc --all)" -ge 2 ] && command -v taskset >/dev/null; then
  PIN_SERVER=(taskset -c 1) PIN_CLIENT=(taskset -c 0)
fi
PALISADE_LOG=warn ip netns exec "$S" "${PIN_SERVER[@]}" "$BIN" run -c "$WORK/palisade.toml" 2>"$WORK/palisade.log" &
PAL_PID=$!
ip netns exec "$S" "${PIN_SERVER[@]}" dnsmasq --keep-in-foreground --no-resolv --no-hosts --bind-interfaces \
  --listen-address=198.18.1.1 --port=5300 --cache-size=10000 --dns-forward-max=1000 \
  --server=/allowed.test/198.18.2.2 --address=/#/ --pid-file="$WORK/dnsmasq.pid" \
  2>"$WORK/dnsmasq.log" &
DNSMASQ_PID=$!
sleep 1

for _ in $(seq 1000); do echo "allowed.test A"; done > "$WORK/allowed.txt"
for i in $(seq 1000); do echo "exfil-$i.denied.test A"; done > "$WORK/denied.txt"

cpu_ticks() { # pid -> utime + stime in clock ticks
  awk '{ sub(/.*\) /, ""); print $12 + $13 }' "/proc/$1/stat"
}
HZ=$(getconf CLK_TCK)
declare -A QPS CPU
run() { # name port file pid
  local out t0 t1 q
  t0=$(cpu_ticks "$4")
  out=$(ip netns exec "$C" "${PIN_CLIENT[@]}" dnsperf -s 198.18.1.1 -p "$2" -d "$3" -l "$SECS" -c 8 -q 200 2>&1)
  t1=$(cpu_ticks "$4")
  q=$(echo "$out" | awk '/Queries completed/ {print $3}')
  local key="$1/$(basename "$3" .txt)"
  QPS[$key]=$(echo "$out" | awk '/Queries per second/ {printf "%.0f", $4}')
  CPU[$key]=$(awk -v t=$((t1 - t0)) -v hz="$HZ" -v q="$q" 'BEGIN { printf "%.1f", (q > 0 ? t / hz * 1e6 / q : 0) }')
  printf '%-10s %-8s %s qps  %s us CPU/query  (%s)\n' "$1" "$(basename "$3" .txt)" \
    "${QPS[$key]}" "${CPU[$key]}" \
    "$(echo "$out" | awk '/Queries lost/ {print "lost " $3 " " $4}')"
}
echo "dnsperf -l $SECS -c 8 -q 200 from the client namespace; $(nproc --all) cores${PIN_SERVER[*]:+, servers on core 1, dnsperf on core 0}"
# Warm both caches.
ip netns exec "$C" dnsperf -s 198.18.1.1 -p 53 -d "$WORK/allowed.txt" -n 1 >/dev/null 2>&1 || true
ip netns exec "$C" dnsperf -s 198.18.1.1 -p 5300 -d "$WORK/allowed.txt" -n 1 >/dev/null 2>&1 || true
run palisade 53 "$WORK/allowed.txt" "$PAL_PID"
run dnsmasq 5300 "$WORK/allowed.txt" "$DNSMASQ_PID"
run palisade 53 "$WORK/denied.txt" "$PAL_PID"
run dnsmasq 5300 "$WORK/denied.txt" "$DNSMASQ_PID"
echo "upstream saw $(grep -c denied.test "$WORK/upstream.jsonl" || true) denied names and $(grep -c allowed.test "$WORK/upstream.jsonl" || true) allowed queries"
echo "evidence records: $(cat "$WORK"/evidence/*.jsonl | wc -l)"

if [ -n "${DNS_MD:-}" ]; then
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 > 0) printf "%.2f×", a / b; else print "–" }'; }
  {
    echo "| DNS (dnsperf -c 8 -q 200, ${SECS} s each) | unit | dnsmasq | Palisade | Palisade/dnsmasq | goal |"
    echo "|---|---|---:|---:|---:|---|"
    for k in allowed denied; do
      if [ "$k" = allowed ]; then name="cached allowed name" goal="CPU ≤ 1.00× (evidence on)"; else name="denied name" goal=""; fi
      echo "| $name, queries/s | qps | ${QPS[dnsmasq/$k]} | ${QPS[palisade/$k]} | $(ratio "${QPS[palisade/$k]}" "${QPS[dnsmasq/$k]}") | |"
      echo "| $name, server CPU per query | µs | ${CPU[dnsmasq/$k]} | ${CPU[palisade/$k]} | $(ratio "${CPU[palisade/$k]}" "${CPU[dnsmasq/$k]}") | $goal |"
    done
  } > "$DNS_MD"
fi
