#!/usr/bin/env bash
# Learned server speeds, live (BENCHMARKS.md, "Learned server speeds and mixed fleets"):
# real Envoy + dist/kvroute.wasm + `kvroute-sim serve`, kvroute with learned speeds and with
# the constant rate (`"cost": {"learn_speeds": false}`), fresh fleet per run.
#   mixed:   2 × H100 + 2 × A100, `bench --workload rag` for 60 s, RUNS runs each
#   slowed:  4 × H100, 30 s, then server 0 slowed 3× (the `slow` fault), 5 s, then 25 s
# Needs `make build setup-envoy`. OUT (default target/live-speeds) gets each run's JSON and
# the per-server rates the filter learned. Ports 24000-24004, 24900, 24901 must be free.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/live-speeds}
RUNS=${RUNS:-2}
SIM=target/release/kvroute-sim
ENVOY=.venv/bin/envoy
mkdir -p "$OUT"

config() { # mode → $OUT/envoy.yaml
  python3 - "$1" "$OUT/envoy.yaml" <<'PY'
import sys
mode, out = sys.argv[1:3]
s = open("envoy/envoy.yaml").read()
for i in range(4):
    s = s.replace(f"port_value: 800{i + 1} ", f"port_value: 2400{i + 1} ")
s = s.replace("port_value: 9901", "port_value: 24901").replace("port_value: 10000", "port_value: 24900")
if mode == "constant":
    s = s.replace('"policy": "cost",', '"policy": "cost", "cost": {"learn_speeds": false},')
open(out, "w").write(s)
PY
}

start() { # fleet args... → SIM_PID, ENVOY_PID
  "$SIM" serve "$@" --base-port 24001 --admin-port 24000 >"$OUT/sim.log" 2>&1 &
  SIM_PID=$!
  "$ENVOY" -c "$OUT/envoy.yaml" --concurrency 2 --use-dynamic-base-id -l warning >"$OUT/envoy.log" 2>&1 &
  ENVOY_PID=$!
  sleep 3
}

stop() {
  kill "$ENVOY_PID" "$SIM_PID" 2>/dev/null || true
  wait "$ENVOY_PID" "$SIM_PID" 2>/dev/null || true
  sleep 1
}

bench() { # seed duration json
  "$SIM" bench --workload rag --seed "$1" --url http://127.0.0.1:24900 --duration "$2" --json "$3" >/dev/null 2>&1
}

for run in $(seq 1 "$RUNS"); do
  for mode in learned constant; do
    config "$mode"
    start --fleet 2xh100-80g:llama-3.1-8b,2xa100-80g:llama-3.1-8b
    bench 0 60 "$OUT/mixed-$mode-$run.json"
    curl -s "127.0.0.1:24901/stats?filter=kvroute.endpoint" >"$OUT/mixed-$mode-$run-rates.txt"
    stop
  done
done

for mode in learned constant; do
  config "$mode"
  start --servers 4
  bench 1 30 "$OUT/slowed-$mode-before.json"
  curl -s -X POST 127.0.0.1:24000/servers/0/fault -H content-type:application/json -d '{"slow": 3}' >/dev/null
  bench 2 5 "$OUT/slowed-$mode-first5.json"
  bench 3 25 "$OUT/slowed-$mode-after.json"
  curl -s "127.0.0.1:24901/stats?filter=kvroute.endpoint" >"$OUT/slowed-$mode-rates.txt"
  stop
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/*.json")):
    doc = json.load(open(f))
    r = doc["runs"][0]
    t = r["ttft_ms"]
    # The bench lists only the servers that answered, so a server that got nothing is
    # missing: look server 0 (port 24001) up by name.
    shares = dict(zip(doc["servers"], (s["share"] for s in r["per_server"])))
    print(f"{os.path.basename(f)}: {r['completed']} done, {r['failed']} failed, TTFT p50 {t['p50']:.1f} p95 {t['p95']:.1f} p99 {t['p99']:.1f} ms, "
          f"hit {100 * r['prefix_hit_rate']:.1f}%, server 0 share {100 * shares.get('127.0.0.1:24001', 0.0):.1f}%")
PY
