#!/usr/bin/env bash
# A gateway that starts in front of a running fleet (BENCHMARKS.md, "A gateway that restarts
# in front of a running fleet"): real Envoy + dist/kvroute.wasm + `kvroute-sim serve`,
# 2 × H100 + 2 × A100. The servers first serve traffic sent to them directly (no gateway),
# then Envoy starts; its per-server prefill rates are read before any request went through
# it, and again after a short rag run through it.
# Needs `make build setup-envoy`. OUT (default target/live-restart). Ports 24000-24004,
# 24900, 24901 must be free.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/live-restart}
SIM=target/release/kvroute-sim
ENVOY=.venv/bin/envoy
mkdir -p "$OUT"
for port in 24000 24001 24002 24003 24004 24900 24901; do
  if python3 -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)) != 0)"; then
    echo "port $port is in use" >&2
    exit 1
  fi
done
# Polls until `$@` succeeds (up to 10 s).
wait_for() {
  for _ in $(seq 1 100); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "timed out waiting for: $*" >&2
  return 1
}
python3 - "$OUT/envoy.yaml" <<'PY'
import sys
s = open("envoy/envoy.yaml").read()
for i in range(4):
    s = s.replace(f"port_value: 800{i + 1} ", f"port_value: 2400{i + 1} ")
s = s.replace("port_value: 9901", "port_value: 24901").replace("port_value: 10000", "port_value: 24900")
open(sys.argv[1], "w").write(s)
PY
"$SIM" serve --fleet 2xh100-80g:llama-3.1-8b,2xa100-80g:llama-3.1-8b --base-port 24001 --admin-port 24000 >"$OUT/sim.log" 2>&1 &
SIM_PID=$!
ENVOY_PID=
trap 'kill $SIM_PID $ENVOY_PID 2>/dev/null || true' EXIT
for port in 24001 24002 24003 24004; do wait_for curl -sf "127.0.0.1:$port/metrics"; done
for port in 24001 24002 24003 24004; do
  "$SIM" bench --workload rag --seed "$port" --url "http://127.0.0.1:$port" --duration 10 >/dev/null 2>&1 &
done
wait $(jobs -p | grep -v "^$SIM_PID$") 2>/dev/null || true
"$ENVOY" -c "$OUT/envoy.yaml" --concurrency 2 --use-dynamic-base-id -l warning >"$OUT/envoy.log" 2>&1 &
ENVOY_PID=$!
# Every server's rate, from the first scrape (none is learned from live samples yet).
wait_for bash -c '[ "$(curl -s 127.0.0.1:24901/stats?filter=prefill_tokens_per_s | wc -l)" -ge 4 ]'
echo "before any request through Envoy:"
curl -s "127.0.0.1:24901/stats?filter=prefill_tokens_per_s" | tee "$OUT/rates-at-start.txt"
"$SIM" bench --workload rag --seed 7 --url http://127.0.0.1:24900 --duration 20 --json "$OUT/bench.json" >/dev/null 2>&1
echo "after 20 s of rag through Envoy:"
curl -s "127.0.0.1:24901/stats?filter=prefill_tokens_per_s" | tee "$OUT/rates-after.txt"
python3 - "$OUT/bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
t = r["ttft_ms"]
print(f"through Envoy: {r['completed']} done, {r['failed']} failed, TTFT p50 {t['p50']:.1f} p95 {t['p95']:.1f} ms, "
      "share per server " + " ".join(f"{100 * s['share']:.0f}%" for s in r["per_server"]))
PY
