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
# (C, `sendmmsg` of 64 queries at a time, replies never read; CPU 1) sends
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

cat >"$work/flood.c" <<'C'
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
int main(int argc, char **argv) {
  int s = socket(AF_INET, SOCK_DGRAM, 0);
  struct sockaddr_in src = {.sin_family = AF_INET}, dst = {.sin_family = AF_INET};
  inet_pton(AF_INET, argv[1], &src.sin_addr);
  dst.sin_port = htons(atoi(argv[2]));
  inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
  if (bind(s, (void *)&src, sizeof src) || connect(s, (void *)&dst, sizeof dst)) {
    perror("flood");
    return 1;
  }
  /* one query: id 0x1234, RD, allowed.bench A IN */
  unsigned char q[] = {0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 7, 'a', 'l', 'l', 'o', 'w', 'e',
                       'd', 5, 'b', 'e', 'n', 'c', 'h', 0, 0, 1, 0, 1};
  struct mmsghdr m[64];
  struct iovec iov = {.iov_base = q, .iov_len = sizeof q};
  memset(m, 0, sizeof m);
  for (int i = 0; i < 64; i++) {
    m[i].msg_hdr.msg_iov = &iov;
    m[i].msg_hdr.msg_iovlen = 1;
  }
  time_t end = time(NULL) + atoi(argv[3]);
  long sent = 0;
  while (time(NULL) < end) {
    int r = sendmmsg(s, m, 64, 0);
    if (r > 0) sent += r;
  }
  printf("the flooder sent %ld datagrams\n", sent);
  return 0;
}
C
cc -O2 -o "$work/flood" "$work/flood.c"

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
  taskset -c 1 "$work/flood" 127.0.0.2 5398 "$FLOOD" >"$work/flood.out" &
  local fl=$!
  sleep 2
  echo "== beta asks on port $1 while alpha floods port 5398"
  taskset -c 1 timeout 30 dnsperf -a 127.0.0.3 -s 127.0.0.1 -p "$1" -d "$work/queries" -l 6 \
    -Q 2000 -c 1 -q 20 -t 1 2>&1 | grep -E "Queries (sent|completed|lost)"
  echo "  the flooded socket dropped $(ss -uamn | grep -A1 '127.0.0.1:5398 ' | grep -o 'd[0-9]*)' | tr -d 'd)') datagrams so far"
  wait "$fl"
  sed 's/^/  /' "$work/flood.out"
  kill "$pal" "$dm"
  wait "$pal" "$dm" 2>/dev/null || true
}
run 5398
run 5396
