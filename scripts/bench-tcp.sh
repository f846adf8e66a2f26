#!/usr/bin/env bash
# bench-tcp.sh — kvxfer TCP transport vs iperf3 on loopback, back to back.
#
# Measures, in one run and interleaved ROUNDS times (default 3):
#   - kvxfer tcp: BenchmarkWrite in engine/tcp, 1 MiB blocks, 64 MiB per
#     transfer batch, sender and receiver transports in one process on
#     127.0.0.1, with STREAMS connections (default: 4, the transport default)
#     and with 1 connection (the same shape as iperf3's single stream);
#   - iperf3 -c 127.0.0.1 -w 4M -l 1M -t SECS against `iperf3 -s -1` on a
#     free port.
# Prints each round, the medians in GB/s (1e9 bytes/s) and the ratios.
# Usage: scripts/bench-tcp.sh            (env: ROUNDS=3 SECS=5 STREAMS=4)
# Needs: go, iperf3 (scripts/install-deps.sh installs it), python3.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
STREAMS=${STREAMS:-4}
command -v iperf3 >/dev/null || { echo "bench-tcp: iperf3 not found; run scripts/install-deps.sh bench" >&2; exit 1; }

tmp=$(mktemp -d)
srv=""
cleanup() { [ -n "$srv" ] && kill "$srv" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

go test -c -o "$tmp/tcp.test" ./engine/tcp

freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# kvx STREAMS -> GB/s
kvx() {
  "$tmp/tcp.test" -test.run '^$' -test.bench "^BenchmarkWrite/streams=$1/block=1MiB\$" \
    -test.benchtime "${SECS}s" 2>&1 | awk '/GB\/s/ { for (i = 1; i < NF; i++) if ($(i+1) == "GB/s") print $i }'
}

# iperf -> GB/s (receiver side, bits/s / 8e9)
iperf() {
  local port; port=$(freeport)
  iperf3 -s -1 -p "$port" >/dev/null 2>&1 & srv=$!
  # wait for the listener without connecting (-1 serves exactly one client)
  for _ in $(seq 50); do ss -Hltn "sport = :$port" | grep -q . && break; sleep 0.1; done
  iperf3 -c 127.0.0.1 -p "$port" -w 4M -l 1M -t "$SECS" -J > "$tmp/iperf.json"
  wait "$srv" 2>/dev/null || true; srv=""
  python3 -c 'import json,sys; print("%.4f" % (json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"]/8e9))' "$tmp/iperf.json"
}

echo "bench-tcp: $(date -u +%FT%TZ) $(uname -srm), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), go $(go env GOVERSION), $(iperf3 --version | head -1)"
declare -a A B C
for r in $(seq "$ROUNDS"); do
  a=$(kvx "$STREAMS"); b=$(kvx 1); c=$(iperf)
  A+=("$a"); B+=("$b"); C+=("$c")
  printf 'round %d: kvxfer tcp streams=%s %s GB/s | kvxfer tcp streams=1 %s GB/s | iperf3 %s GB/s\n' "$r" "$STREAMS" "$a" "$b" "$c"
done
python3 - "${A[*]}" "${B[*]}" "${C[*]}" "$STREAMS" <<'PY'
import statistics, sys
a, b, c = (list(map(float, s.split())) for s in sys.argv[1:4])
ma, mb, mc = statistics.median(a), statistics.median(b), statistics.median(c)
print(f"median: kvxfer tcp streams={sys.argv[4]}: {ma:.3f} GB/s, streams=1: {mb:.3f} GB/s, iperf3 (1 stream, -w 4M -l 1M): {mc:.3f} GB/s")
print(f"ratio kvxfer/iperf3: streams={sys.argv[4]}: {ma/mc:.2f}x, streams=1: {mb/mc:.2f}x (goal >= 0.80x)")
PY
