#!/usr/bin/env bash
# Whether one address flooding the DNS shim over UDP, faster than the shim
# answers, takes another org's queries down with it; and whether a listen
# address of the other org's own keeps them:
#
#   sudo bench/dns-starve.sh [BIN]     # default BIN: target/release/palisade
#
# Palisade (pinned to CPU 0) listens on two loopback ports, 5398 and 5396,
# for two orgs: alpha (127.0.0.2) and beta (127.0.0.3), both allowed
# allowed.bench (answered by a loopback dnsmasq and then kept). A flooder
# (tests/fixtures/udpflood.c, the netns test `dns_flood`'s: `sendmmsg` of
# 64 queries at a time, replies never read; CPU 1) sends
# alpha's queries to port 5398 for FLOOD seconds (default 12). Two seconds
# in, `dnsperf` asks for beta at 2,000 queries a second for 6 s (one query
# in flight per 1 s timeout at most 20, CPU 1), first on the same port and
# then, in a second run, on port 5396. Prints dnsperf's counts for beta,
# the datagrams the shim's flooded socket dropped (`ss`'s `d`) and how many
# the flooder sent. Needs cc, dnsmasq, dnsperf and taskset.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath "${1:-target/release/palisade}")
FLOOD=${FLOOD:-12}
work=$(mktemp -d /tmp/palisade-starve.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
for tool in cc dnsmasq dnsperf taskset ss; do
  command -v "$tool" >/dev/null || { echo "missing: $tool" >&2; exit 1; }
done

cc -O2 -o "$work/flood" tests/fixtures/udpflood.c

org() { # org NAME ADDRESS
  printf '[[org]]\nname = "%s"\nclients = ["%s/32"]\n' "$1" "$2"
  printf '[[org.allow]]\nhost = "allowed.bench"\nports = [80]\n'
  printf '[[org.allow]]\ncidr = "127.0.0.1/32"\nports = [80]\n'
}
{
  printf '[proxy]\nlisten = ["127.0.0.1:3198"]\n'
  printf '[dns]\nlisten = ["127.0.0.1:5398", "127.0.0.1:5396"]\nupstream = ["127.0.0.1:5397"]\n'
  printf 'max_queries_per_second_per_client = 100000000\nmax_queries_in_flight = 100000\n'
  printf '[admin]\nlisten = "127.0.0.1:9798"\n'
  printf '[evidence]\ndir = "%s/evidence"\n' "$work"
  org alpha 127.0.0.2
  org beta 127.0.0.3
} >"$work/palisade.toml"
printf 'allowed.bench A\n' >"$work/queries"

run() { # run PORT: beta asks on PORT while alpha floods 5398
  rm -rf "$work/evidence"
  dnsmasq -k --port=5397 --listen-address=127.0.0.1 --bind-interfaces --no-resolv --no-hosts \
    --address=/allowed.bench/127.0.0.1 --pid-file= >"$work/dnsmasq.log" 2>&1 &
  local dm=$!
  taskset -c 0 "$BIN" run -c "$work/palisade.toml" >"$work/palisade.log" 2>&1 &
  local pal=$!
  sleep 2
  taskset -c 1 "$work/flood" 127.0.0.2 127.0.0.1 5398 allowed.bench "$FLOOD" >"$work/flood.out" &
  local fl=$!
  sleep 2
  echo "== beta asks on port $1 while alpha floods port 5398"
  taskset -c 1 timeout 30 dnsperf -a 127.0.0.3 -s 127.0.0.1 -p "$1" -d "$work/queries" -l 6 \
    -Q 2000 -c 1 -q 20 -t 1 2>&1 | grep -E "Queries (sent|completed|lost)"
  echo "  the flooded socket dropped $(ss -uamn | grep -A1 '127.0.0.1:5398 ' | grep -o 'd[0-9]*)' | tr -d 'd)') datagrams so far"
  wait "$fl"
  sed 's/^/  the flooder /' "$work/flood.out"
  kill "$pal" "$dm"
  wait "$pal" "$dm" 2>/dev/null || true
}
run 5398
run 5396
