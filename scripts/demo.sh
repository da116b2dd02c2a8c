#!/usr/bin/env bash
# `make run`: four simulated vLLM servers (Llama-3.1-8B on H100) behind real Envoy, first
# with kvroute (envoy/envoy.yaml), then with plain round-robin (envoy/envoy-round-robin.yaml),
# the same shared-prefix workload through each, then one side-by-side table and an SVG
# report. Every process it starts is stopped on exit, on failure and on Ctrl-C.
#
# Knobs (environment): RATE (requests/s, default 140), OUT (default target/demo).
set -euo pipefail
cd "$(dirname "$0")/.."

SIM=target/release/kvroute-sim
ENVOY=.venv/bin/envoy
OUT=${OUT:-target/demo}
RATE=${RATE:-140}
WORKLOAD=(--workload shared-prefix --rate "$RATE" --output-tokens 32)
PORTS=(8000 8001 8002 8003 8004 9901 10000)

pids=()
stop_all() {
  for p in "${pids[@]+"${pids[@]}"}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]+"${pids[@]}"}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap stop_all EXIT
trap 'echo; echo "interrupted: stopping everything"; exit 130' INT TERM

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

for p in "${PORTS[@]}"; do
  if port_open "$p"; then
    echo "port $p is already in use: stop whatever listens there (make run needs ${PORTS[*]})" >&2
    exit 1
  fi
done
[ -x "$SIM" ] && [ -x "$ENVOY" ] && [ -f dist/kvroute.wasm ] || { echo "run through 'make run' (it builds first)" >&2; exit 1; }
mkdir -p "$OUT"

wait_ready() {
  for _ in $(seq 1 150); do
    if port_open 8004 && port_open 10000 && curl -sf http://127.0.0.1:9901/ready >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.1
  done
  echo "Envoy or the simulated servers did not come up; logs in $OUT/" >&2
  return 1
}

run_side() {
  local label=$1 config=$2
  echo "==> [$label] starting 4 simulated vLLM servers and Envoy ($config)"
  "$SIM" serve --servers 4 --base-port 8001 >"$OUT/sim-$label.log" 2>&1 &
  pids+=($!)
  "$ENVOY" -c "$config" --concurrency 2 -l warn --log-path "$OUT/envoy-$label.log" >/dev/null 2>&1 &
  pids+=($!)
  wait_ready
  sleep 1 # a few metrics scrapes reach kvroute's workers
  echo "==> [$label] shared-prefix workload: 1024 requests (64 groups x 16, 2048-token system prompts, 128-token questions, 32 output tokens) at $RATE req/s"
  "$SIM" bench --url http://127.0.0.1:10000 "${WORKLOAD[@]}" --duration 120 --label "$label" --json "$OUT/$label.json" >"$OUT/bench-$label.txt"
  tail -n +4 "$OUT/bench-$label.txt" | sed 's/^/    /'
  stop_all
}

run_side kvroute envoy/envoy.yaml
run_side round-robin envoy/envoy-round-robin.yaml

echo
echo "==> kvroute vs round-robin, same Envoy, same simulated fleet (latencies in ms)"
"$SIM" compare "$OUT/kvroute.json" "$OUT/round-robin.json" --plot "$OUT/report.svg" \
  --title "shared-prefix at $RATE req/s, 4 x Llama-3.1-8B on H100 (simulated): kvroute vs round-robin"
