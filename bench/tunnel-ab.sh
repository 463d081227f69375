#!/usr/bin/env bash
# New CONNECT tunnels at concurrency 64, as the harness's `tunnel_c64`
# figure measures them, for one or more Palisade builds beside HAProxy as
# a bare relay (the floor of relaying), alternating, in one run:
#
#   sudo bench/tunnel-ab.sh ROUNDS BIN[:EXTRA] [BIN[:EXTRA]...]
#
# Each server alone on core 0; the loadgen and a loopback nginx (GET
# /small, 100 bytes) on core 1. Per run: tunnels per second and the
# server's CPU per tunnel (user + system, from /proc). EXTRA is a file of
# lines added to the build's `[evidence]` section (e.g. `durability =
# "discard"`), so one binary can be measured in two configurations. Each
# build is configured as ../shared/bench/palisade-put.sh configures it:
# evidence on, allowed.bench allowed by name and 127.0.0.1 by a cidr rule.
# Prints each run and the medians with the ratios to the relay. DUR (s,
# default 5) and CONC (default 64) per run. KEEPALIVE=on measures the
# harness's `fwd_ka_c64` instead: absolute-form GETs over kept-alive
# connections (the relay's kept alive too), a "tunnel" then being a
# request. Needs nginx, dnsmasq, haproxy,
# taskset, python3 and the loadgen (built by ../shared/bench/run-palisade.sh,
# or LOADGEN=path).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:?usage: bench/tunnel-ab.sh ROUNDS BIN[:EXTRA]...}
shift
[ "$#" -gt 0 ] || { echo "usage: bench/tunnel-ab.sh ROUNDS BIN[:EXTRA]..." >&2; exit 2; }
DUR=${DUR:-5}
CONC=${CONC:-64}
KEEPALIVE=${KEEPALIVE:-off}
LOADGEN=${LOADGEN:-../shared/bench/loadgen/target/release/loadgen}
for t in nginx dnsmasq haproxy taskset python3 "$LOADGEN"; do
  command -v "$t" >/dev/null || [ -x "$t" ] || { echo "missing: $t" >&2; exit 1; }
done
run=$(mktemp -d /tmp/palisade-tunnel-ab.XXXXXX)
chmod 755 "$run" # nginx workers and dnsmasq drop root and read their files
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$run"
}
trap cleanup EXIT

. bench/floors.sh
origin_files "$run"
taskset -c 1 nginx -c "$run/nginx.conf" -p "$run/nginx" &
pids+=($!)
taskset -c 1 dnsmasq -k --port=15310 --listen-address=127.0.0.1 --bind-interfaces --no-resolv \
  --no-hosts --local-ttl=300 --addn-hosts="$run/hosts" --pid-file= >/dev/null 2>&1 &
pids+=($!)
relay_cfg "$run/haproxy.cfg"
taskset -c 0 haproxy -db -f "$run/haproxy.cfg" >"$run/haproxy.log" 2>&1 &
relay=$!
pids+=("$relay")


# Each build on its own ports and evidence, started on core 0 (a runtime
# sized from its CPU affinity has one worker, as in the harness).
servers=()
i=0
for spec in "$@"; do
  bin=${spec%%:*}
  extra=
  [ "$spec" != "$bin" ] && extra=${spec#*:}
  port=$((13140 + i))
  {
    printf '[proxy]\nlisten = ["127.0.0.1:%s"]\n' "$port"
    printf 'max_new_connections_per_second_per_org = 100000000\n'
    printf '[dns]\nlisten = ["127.0.0.1:%s"]\nupstream = ["127.0.0.1:15310"]\n' "$((15320 + i))"
    printf '[admin]\nlisten = "127.0.0.1:%s"\n' "$((19720 + i))"
    printf '[evidence]\ndir = "%s"\n' "$run/ev$i"
    if [ -n "$extra" ]; then cat "$extra"; fi
    printf '[[org]]\nname = "bench"\nclients = ["127.0.0.0/8"]\n'
    printf '[[org.allow]]\nhost = "allowed.bench"\nports = [18080]\n'
    printf '[[org.allow]]\ncidr = "127.0.0.1/32"\nports = [18080]\n'
  } >"$run/p$i.toml"
  taskset -c 0 "$bin" run -c "$run/p$i.toml" >"$run/p$i.log" 2>&1 &
  pids+=($!)
  servers+=("$i-$(basename "$bin")${extra:++$(basename "$extra")}|$port|$!")
  i=$((i + 1))
done
# What did not come up says why in its log.
ports=(18080 13150)
for s in "${servers[@]}"; do ports+=("$(cut -d'|' -f2 <<<"$s")"); done
for port in "${ports[@]}"; do
  wait_port "$port" || { tail -n 20 "$run"/*.log >&2 || true; exit 1; }
done

for _ in $(seq 1 "$ROUNDS"); do
  for s in "${servers[@]}" "relay|13150|$relay"; do
    IFS='|' read -r name port pid <<<"$s"
    if [ "$name" = relay ]; then
      args=(direct-rate --backend 127.0.0.1:13150 --keepalive "$KEEPALIVE")
    elif [ "$KEEPALIVE" = on ]; then
      args=(forward-rate --proxy "127.0.0.1:$port" --keepalive on)
    else
      args=(tunnel-rate --proxy "127.0.0.1:$port")
    fi
    taskset -c 1 timeout $((DUR + 30)) "$LOADGEN" "${args[@]}" --host allowed.bench:18080 \
      --path /small --concurrency "$CONC" --duration "$DUR" --warmup 1 --cpu-pid "$pid" \
      --label "$name" >"$run/out.json"
    python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
ok = max(j.get("ok", 0), 1)
print(j["label"], round(j["rate_per_s"]), round(j["proxy_cpu_s"] * 1e6 / ok, 1))
' "$run/out.json"
  done
done | tee "$run/runs"
python3 - "$run/runs" <<'PY'
import collections, statistics, sys
rate, cpu = collections.defaultdict(list), collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, r, c = line.split()
    rate[name].append(float(r))
    cpu[name].append(float(c))
rr, rc = statistics.median(rate["relay"]), statistics.median(cpu["relay"])
for name in rate:
    r, c = statistics.median(rate[name]), statistics.median(cpu[name])
    print(f"{name}: {r:.0f} tunnels/s ({r / rr:.3f}x the relay), "
          f"{c:.1f} us CPU per tunnel ({c / rc:.3f}x)")
PY
