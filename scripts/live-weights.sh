#!/usr/bin/env bash
# Speed weights for a fleet that starts cold, live (BENCHMARKS.md, "Speed weights for a
# fleet that starts cold"): real Envoy + dist/kvroute.wasm + `kvroute-sim serve` with
# 2 × H100 + 2 × A100 started fresh for every run, `bench --workload WORKLOAD` (multi-turn
# unless set) for 60 s, kvroute as shipped ("plain") and with the H100s at
# load_balancing_weight 3 in the pool cluster and `cost.speed_weights_from_envoy` on
# ("weighted": kvroute reads the weights from Envoy's /clusters), RUNS runs of each,
# alternating; RATE_SCALE multiplies the workload's arrival rate. Needs `make build
# setup-envoy`. OUT (default target/live-weights) gets each run's JSON and the filter's
# per-server stats. Ports 24000-24004, 24900, 24901 must be free.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/live-weights}
RUNS=${RUNS:-3}
RATE_SCALE=${RATE_SCALE:-1}  # multiplies the workload's default arrival rate
WORKLOAD=${WORKLOAD:-multi-turn}  # or rag, shared-prefix
SIM=target/release/kvroute-sim
ENVOY=.venv/bin/envoy
mkdir -p "$OUT"

config() { # mode → $OUT/envoy.yaml
  python3 - "$1" "$OUT/envoy.yaml" <<'PY'
import sys
mode, out = sys.argv[1:3]
s = open("envoy/envoy.yaml").read()
for i in range(4):
    line = f"- endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 800{i + 1} }} }} }}"
    assert line in s, line
    weight = " } } }, load_balancing_weight: 3 }" if mode == "weighted" and i < 2 else " } } } }"
    s = s.replace(line, f"- {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 2400{i + 1}{weight}")
if mode == "weighted":
    s = s.replace('"policy": "cost",', '"policy": "cost", "cost": {"speed_weights_from_envoy": true},')
s = s.replace("port_value: 9901", "port_value: 24901").replace("port_value: 10000", "port_value: 24900")
open(out, "w").write(s)
PY
}

for run in $(seq 1 "$RUNS"); do
  for mode in plain weighted; do
    config "$mode"
    "$SIM" serve --fleet 2xh100-80g:llama-3.1-8b,2xa100-80g:llama-3.1-8b --base-port 24001 --admin-port 24000 >"$OUT/sim.log" 2>&1 &
    SIM_PID=$!
    "$ENVOY" -c "$OUT/envoy.yaml" --concurrency 2 --use-dynamic-base-id -l warning >"$OUT/envoy.log" 2>&1 &
    ENVOY_PID=$!
    sleep 3
    "$SIM" bench --workload "$WORKLOAD" --rate-scale "$RATE_SCALE" --seed "$run" --url http://127.0.0.1:24900 --duration 60 --json "$OUT/$mode-$run.json" >/dev/null 2>&1
    curl -s "127.0.0.1:24901/stats?filter=kvroute.endpoint" >"$OUT/$mode-$run-stats.txt"
    kill "$ENVOY_PID" "$SIM_PID" 2>/dev/null || true
    wait "$ENVOY_PID" "$SIM_PID" 2>/dev/null || true
    sleep 1
  done
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/*.json")):
    doc = json.load(open(f))
    r = doc["runs"][0]
    t = r["ttft_ms"]
    shares = dict(zip(doc["servers"], (s["share"] for s in r["per_server"])))
    h100 = sum(v for k, v in shares.items() if k.endswith(":24001") or k.endswith(":24002"))
    print(f"{os.path.basename(f)}: {r['completed']} done, {r['failed']} failed, TTFT p50 {t['p50']:.1f} p95 {t['p95']:.1f} p99 {t['p99']:.1f} ms, "
          f"H100 share {h100 * 100:.1f}%, hit {r['prefix_hit_rate'] * 100:.1f}%")
PY
