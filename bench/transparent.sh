#!/usr/bin/env bash
# Transparent mode against explicit mode, same run, same upstream:
# tunnel throughput (one large body) and new connections per second.
#
#   cargo build --release && sudo bench/transparent.sh [BODY_MIB] [CONNECTIONS]
#
# Three throwaway network namespaces on 198.18.0.0/15 (client, gateway,
# upstream), no link to the root namespace. The gateway runs Palisade with
# an explicit and a transparent listener behind docker/nftables.conf; the
# upstream is a small Python server. Every loop is bounded. Prints a
# markdown table, with proxy CPU seconds per GiB and per 1,000 connections
# from /proc (so an upstream or client bottleneck shows as equal rates with
# different proxy CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
BODY_MIB=${1:-256}
CONNS=${2:-2000}
BIN=target/release/palisade
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "needs root (network namespaces)" >&2; exit 1; }

tag="plbench$$"
C="$tag-c"; G="$tag-g"; U="$tag-u"
work=$(mktemp -d)
cleanup() {
  for ns in "$C" "$G" "$U"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

for ns in "$C" "$G" "$U"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip -n "$G" link add g0 type veth peer name c0 netns "$C"
ip -n "$G" link add g1 type veth peer name u0 netns "$U"
ip -n "$C" addr add 198.18.1.2/24 dev c0
ip -n "$G" addr add 198.18.1.1/24 dev g0
ip -n "$G" addr add 198.18.2.1/24 dev g1
ip -n "$U" addr add 198.18.2.10/24 dev u0
for l in "$C c0" "$G g0" "$G g1" "$U u0"; do set -- $l; ip -n "$1" link set "$2" up; done
ip -n "$C" route add default via 198.18.1.1
ip netns exec "$G" sh -c 'echo 0 > /proc/sys/net/ipv4/ip_forward'
sed -e 's/^define SANDBOX_IF = .*/define SANDBOX_IF = "g0"/' docker/nftables.conf | ip netns exec "$G" nft -f -

head -c $((BODY_MIB * 1024 * 1024)) /dev/zero > "$work/big"
echo ok > "$work/small"
cat > "$work/upstream.py" <<'PY'
import http.server, os, socketserver, sys
root = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        path = os.path.join(root, os.path.basename(self.path))
        size = os.path.getsize(path)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        with open(path, "rb") as f:
            os.sendfile(self.wfile.fileno(), f.fileno(), 0, size)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 1024
S(("198.18.2.10", 80), H).serve_forever()
PY
ip netns exec "$U" python3 "$work/upstream.py" "$work" &
cat > "$work/palisade.toml" <<EOF
[proxy]
listen = ["198.18.1.1:3128"]
transparent = ["198.18.1.1:15001"]
max_connections_per_org = 100000
max_new_connections_per_second_per_org = 1000000
[dns]
listen = []
upstream = []
[admin]
listen = "198.18.1.1:9711"
[evidence]
dir = "$work/evidence"
[[org]]
name = "bench"
clients = ["198.18.1.0/24"]
[[org.allow]]
cidr = "198.18.2.10/32"
ports = [80]
EOF
ip netns exec "$G" "$BIN" run -c "$work/palisade.toml" 2>"$work/palisade.log" &
for _ in $(seq 100); do
  ip netns exec "$G" curl -sf -o /dev/null http://198.18.1.1:9711/readyz && break; sleep 0.1
done
for _ in $(seq 100); do
  ip netns exec "$U" curl -sf -o /dev/null http://198.18.2.10/small && break; sleep 0.1
done
pid=$(ip netns pids "$G" | head -n1)
cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
hz=$(getconf CLK_TCK)

throughput() { # mode -> "MiB/s cpu_s_per_gib"
  local before after rate
  before=$(cpu)
  if [ "$1" = explicit ]; then
    rate=$(ip netns exec "$C" curl -sS -p -x http://198.18.1.1:3128 -o /dev/null -w '%{speed_download}' http://198.18.2.10/big)
  else
    rate=$(ip netns exec "$C" curl -sS --noproxy '*' -o /dev/null -w '%{speed_download}' http://198.18.2.10/big)
  fi
  after=$(cpu)
  awk -v r="$rate" -v b="$before" -v a="$after" -v hz="$hz" -v mib="$BODY_MIB" \
    'BEGIN { printf "%.0f %.3f", r / 1048576, (a - b) / hz / (mib / 1024) }'
}

cat > "$work/conns.py" <<'PY'
import socket, sys, time
mode, n = sys.argv[1], int(sys.argv[2])
req = b"GET http://198.18.2.10/small HTTP/1.1\r\nHost: 198.18.2.10\r\nConnection: close\r\n\r\n"
deadline = time.monotonic() + 120
done = 0
start = time.monotonic()
for _ in range(n):
    if time.monotonic() > deadline:
        break
    if mode == "explicit":
        s = socket.create_connection(("198.18.1.1", 3128), timeout=5)
        s.sendall(b"CONNECT 198.18.2.10:80 HTTP/1.1\r\nHost: 198.18.2.10:80\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
    else:
        s = socket.create_connection(("198.18.2.10", 80), timeout=5)
    s.sendall(b"GET /small HTTP/1.1\r\nHost: 198.18.2.10\r\nConnection: close\r\n\r\n")
    while s.recv(4096):
        pass
    s.close()
    done += 1
print(done, time.monotonic() - start)
PY
rate() { # mode -> "conn/s cpu_ms_per_1000"
  local before after out
  before=$(cpu)
  out=$(ip netns exec "$C" python3 "$work/conns.py" "$1" "$CONNS")
  after=$(cpu)
  set -- $out
  awk -v n="$1" -v t="$2" -v b="$before" -v a="$after" -v hz="$hz" \
    'BEGIN { printf "%.0f %.0f", n / t, (a - b) / hz * 1000 / n * 1000 }'
}

read -r te ce <<<"$(throughput explicit)"
read -r tt ct <<<"$(throughput transparent)"
read -r re cre <<<"$(rate explicit)"
read -r rt crt <<<"$(rate transparent)"
echo "| scenario | explicit (CONNECT) | transparent | transparent/explicit |"
echo "|---|---|---|---|"
awk -v a="$te" -v b="$tt" 'BEGIN { printf "| tunnel throughput, one %s MiB body | %s MiB/s | %s MiB/s | %.2f |\n", ENVIRON["BODY_MIB"], a, b, b / a }'
awk -v a="$ce" -v b="$ct" 'BEGIN { printf "| proxy CPU per GiB | %s s | %s s | %.2f |\n", a, b, b / a }'
awk -v a="$re" -v b="$rt" -v n="$CONNS" 'BEGIN { printf "| new connections per second (%s, sequential) | %s | %s | %.2f |\n", n, a, b, b / a }'
awk -v a="$cre" -v b="$crt" 'BEGIN { printf "| proxy CPU per 1,000 connections | %s ms | %s ms | %.2f |\n", a, b, b / a }'
