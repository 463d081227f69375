#!/usr/bin/env bash
# The whole performance table in one run on one machine:
#
#   sudo bench/run.sh            # writes bench/results.md
#
# Installs what it needs from Debian if missing (squid, dnsmasq-base,
# dnsperf, iproute2, python3; squid's system service is never started),
# builds Palisade in release, then runs
#   1. benches/load.rs  direct vs Palisade vs squid: new CONNECT tunnels/s at
#      concurrency 1 and 64 with p50/p99, proxy CPU per tunnel, tunnel
#      throughput (1 and 8 streams), absolute-form GETs with and without
#      keep-alive, RSS per idle tunnel (proxies on core 1, load on core 0);
#   2. benches/policy.rs decision cost at 10 and 10,000 rules;
#   3. bench/dns.sh      DNS shim vs dnsmasq, cached allowed and denied names;
# and writes the tables, with this command and the machine, to
# bench/results.md (RESULTS=FILE to write elsewhere). Every run inside is
# bounded in count and time. Knobs: LOAD_SECS, LOAD_ROUNDS, LOAD_IDLE
# (see benches/load.rs), DNS_SECS.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS="${RESULTS:-bench/results.md}"
DNS_SECS="${DNS_SECS:-5}"
OUT="${CARGO_TARGET_DIR:-target}/bench"
mkdir -p "$OUT"

if [ "$(id -u)" -ne 0 ]; then
  echo "bench/run.sh: needs root (network namespaces for the DNS bench, apt-get)" >&2
  exit 1
fi

missing=()
command -v squid >/dev/null || [ -x /usr/sbin/squid ] || missing+=(squid)
command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || missing+=(dnsmasq-base)
command -v dnsperf >/dev/null || missing+=(dnsperf)
command -v ip >/dev/null || missing+=(iproute2)
command -v python3 >/dev/null || missing+=(python3)
command -v taskset >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]}"
  # Keep the packages' services from starting system-wide: squid runs only
  # in the foreground with the bench's own config.
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
fi
export PATH="$PATH:/usr/sbin:/sbin"

cargo build --release --quiet
LOAD_OUT="$OUT/load.md" cargo bench --quiet --bench load
cargo bench --quiet --bench policy | tee "$OUT/policy.txt"
DNS_MD="$OUT/dns.md" PALISADE_BIN="${CARGO_TARGET_DIR:-target}/release/palisade" bench/dns.sh "$DNS_SECS" | tee "$OUT/dns.txt"

{
  echo "# Palisade performance"
  echo
  echo "Produced by \`sudo bench/run.sh\` on $(date -u +%Y-%m-%d) (commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))."
  echo "Machine: $(nproc --all) cores ($(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)),"
  echo "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), Linux $(uname -r);"
  echo "$(squid -v 2>/dev/null | head -1 | sed 's/Version //'), $(dnsmasq -v 2>/dev/null | head -1 | sed 's/ Copyright.*//'), $(rustc -V)."
  echo
  echo "## Proxy paths"
  echo
  cat "$OUT/load.md"
  echo
  echo "## Decision cost (benches/policy.rs)"
  echo
  echo "| case | 10 rules | 10,000 rules | 10,000/10 | goal |"
  echo "|---|---:|---:|---:|---|"
  awk '/ ns / { name = $1; for (i = 2; i <= NF - 5; i++) name = name " " $i;
                printf "| %s | %s ns | %s ns | %s× | ≤ 2 µs at 10,000 rules |\n", name, $(NF-4), $(NF-2), $NF }' \
    "$OUT/policy.txt"
  echo
  echo "## DNS (bench/dns.sh)"
  echo
  cat "$OUT/dns.md"
} > "$RESULTS"
echo "wrote $RESULTS"
