#!/usr/bin/env bash
# vLLM's 503 refusals, live (BENCHMARKS.md, "vLLM's 503 refusals, live"): real Envoy +
# dist/kvroute.wasm + `kvroute-sim serve` with vLLM's admission limit
# (`--max-num-queued-reqs LIMIT`), fresh fleet per run. Modes (MODES, all by default):
#   no-retry:        the shipped envoy.yaml (the client gets every refusal)
#   retry:           plus the opt-in 503 retry on kvroute's next server
#   retry-avoid:     plus overload.refused_ms 1000 (a refusing server goes last for 1 s)
#   retry-avoid-200: the same with 200 ms
#   hold-no-retry, hold-retry: no-retry and retry with overload.hold on (max_wait_ms 1000,
#                    wait_limit_ms 100)
# RATE req/s of the steady-state workload (400 prefixes) for DURATION s; SLOW=k slows server
# 0 k times (a hot spot in a fleet with room). Needs `make build setup-envoy`. OUT (default
# target/live-refusals) gets each run's JSON. Ports 24000-24004, 24900, 24901 must be free.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/live-refusals}
RUNS=${RUNS:-2}
RATE=${RATE:-150}
DURATION=${DURATION:-20}
LIMIT=${LIMIT:-16}
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
shipped = "retry_on: connect-failure,reset-before-request,refused-stream,reset\n"
assert shipped in s
overload = {}
if "hold" in mode:
    overload["hold"] = {"max_wait_ms": 1000, "wait_limit_ms": 100}
if "avoid" in mode:
    overload["refused_ms"] = 200 if mode.endswith("-200") else 1000
if overload:
    import json
    s = s.replace('"policy": "cost",', '"policy": "cost", "overload": %s,' % json.dumps(overload))
if "no-retry" not in mode:
    s = s.replace(shipped, shipped.rstrip("\n") + ",retriable-status-codes\n" + " " * 30 + "retriable_status_codes: [503]\n")
open(out, "w").write(s)
PY
}

for run in $(seq 1 "$RUNS"); do
  for mode in ${MODES:-no-retry retry retry-avoid retry-avoid-200 hold-no-retry hold-retry}; do
    config "$mode"
    "$SIM" serve --servers 4 --max-num-queued-reqs "$LIMIT" --base-port 24001 --admin-port 24000 >"$OUT/sim.log" 2>&1 &
    SIM_PID=$!
    "$ENVOY" -c "$OUT/envoy.yaml" --concurrency 2 --use-dynamic-base-id -l warning >"$OUT/envoy.log" 2>&1 &
    ENVOY_PID=$!
    sleep 3
    if [ -n "${SLOW:-}" ]; then # a hot spot: server 0 SLOW times slower than the others
      curl -s -X POST 127.0.0.1:24000/servers/0/fault -H content-type:application/json -d "{\"slow\": $SLOW}" >/dev/null
    fi
    "$SIM" bench --workload shared-prefix --groups 400 --per-group 30 --rate "$RATE" --output-tokens 32 \
      --seed "$run" --url http://127.0.0.1:24900 --duration "$DURATION" --json "$OUT/$mode-$run.json" >/dev/null 2>&1 \
      || true # bench exits non-zero when requests failed: the refusals are what is measured
    curl -s "127.0.0.1:24901/stats?filter=(upstream_rq_retry$|upstream_rq_503|kvroute.refused)" >"$OUT/$mode-$run-stats.txt"
    kill "$ENVOY_PID" "$SIM_PID" 2>/dev/null || true
    wait "$ENVOY_PID" "$SIM_PID" 2>/dev/null || true
    sleep 1
  done
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/*.json")):
    r = json.load(open(f))["runs"][0]
    t = r["ttft_ms"]
    stats = open(f[:-5] + "-stats.txt").read().split("\n")
    keep = ", ".join(l.strip() for l in stats if l.strip() and ("retry:" in l or "refused" in l or "vllm_pool.upstream_rq_503" in l))
    print(f"{os.path.basename(f)}: {r['completed']} done, {r['failed']} failed, TTFT p50 {t['p50']:.1f} p95 {t['p95']:.1f} p99 {t['p99']:.1f} ms, "
          f"out tok/s {r['throughput']['output_tok_s']:.0f}, hit {100 * r['prefix_hit_rate']:.1f}% | {keep}")
PY
