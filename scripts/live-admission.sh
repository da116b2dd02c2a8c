#!/usr/bin/env bash
# The admission wait, live (BENCHMARKS.md, "The admission wait: servers whose sequence slots
# are full"): real Envoy + dist/kvroute.wasm + `kvroute-sim serve`, a fresh fleet per run, the
# same chat workload (shared system prompts, long answers) routed with the wait charged
# (`cost.admission_weight` 1, the default) and without it (0), runs interleaved.
#
# The fleet is FLEET (default 3 A100s with 32 sequence slots + 1 H100 with vLLM's 1,024):
# at the rates a 2-core machine drives, an A100's default 256 slots never fill, and the wait
# is about servers whose slots are full beside servers with room. Prints, per run and as
# medians: the share of the requests offered whose TTFT met OBJECTIVE_MS (from the bench's
# 1%-step TTFT CDF; a failed request misses), TTFT p50 and p95, and the A100s' share.
# RATE and DURATION are whole numbers. Needs `make build setup-envoy`. Ports 25000 on (one
# per server), 25900 and 25901 must be free.
#   RUNS=3 DURATION=60 RATE=32 OUT=target/live-admission bash scripts/live-admission.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/live-admission}
RUNS=${RUNS:-3}
DURATION=${DURATION:-60}
RATE=${RATE:-32}
for v in RATE DURATION RUNS; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "$v must be a whole number of at least 1 (got ${!v})" >&2; exit 2; }
done
OBJECTIVE_MS=${OBJECTIVE_MS:-500}
FLEET=${FLEET:-3xa100-80g:llama-3.1-8b:seqs32,1xh100-80g:llama-3.1-8b}
# 32 system prompts, each asked RATE × DURATION / 32 questions: the run's requests.
CHAT=(--workload shared-prefix --groups 32 --per-group $(( (RATE * DURATION + 31) / 32 )) --system-tokens 512
  --question-tokens 128 --output-tokens "${OUTPUT_TOKENS:-512}")
SIM=target/release/kvroute-sim
ENVOY=.venv/bin/envoy
mkdir -p "$OUT"
for f in "$SIM" "$ENVOY" dist/kvroute.wasm; do
  [ -e "$f" ] || { echo "missing $f: run make build setup-envoy" >&2; exit 2; }
done
SERVERS=$(python3 -c "import sys; print(sum(int(p.split('x')[0]) for p in sys.argv[1].split(',')))" "$FLEET")
# A run interrupted leaves no Envoy or simulator behind.
envoy='' sim=''
trap 'kill $envoy $sim 2>/dev/null || true' EXIT

config() { # admission weight → $OUT/envoy.yaml
  python3 - "$SERVERS" "$1" "$OUT/envoy.yaml" <<'PY'
import sys
sys.path.insert(0, "scripts")
from live_fleet import envoy_config
n, weight, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
open(out, "w").write(envoy_config(n, 25001, 25900, 25901, f'"cost": {{"admission_weight": {weight}}},'))
PY
}

run() { # name, admission weight, run
  local name=$1 weight=$2 n=$3
  config "$weight"
  "$SIM" serve --fleet "$FLEET" --base-port 25001 --admin-port 25000 >"$OUT/sim.log" 2>&1 &
  sim=$!
  "$ENVOY" -c "$OUT/envoy.yaml" --concurrency 2 --use-dynamic-base-id -l warning >"$OUT/envoy.log" 2>&1 &
  envoy=$!
  sleep 3
  "$SIM" bench "${CHAT[@]}" --rate "$RATE" --seed "$n" --url http://127.0.0.1:25900 \
    --duration "$DURATION" --json "$OUT/$name-$n.json" >/dev/null 2>&1 || echo "$name run $n: bench failed" >&2
  kill "$envoy" "$sim" 2>/dev/null || true
  wait "$envoy" "$sim" 2>/dev/null || true
  envoy='' sim=''
  sleep 1
}

for n in $(seq 1 "$RUNS"); do
  run without 0 "$n"
  run with 1 "$n"
done

python3 - "$OUT" "$RUNS" "$OBJECTIVE_MS" "$FLEET" "$RATE" <<'PY'
import sys
sys.path.insert(0, "scripts")
from live_fleet import bench_runs, met, share_of, spread
out, runs, objective, fleet, rate = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
# Server i of the fleet (in FLEET's order) listens on port 25001 + i.
gpus = [p.split("x", 1)[1].split(":")[0] for p in fleet.split(",") for _ in range(int(p.split("x")[0]))]
print(f"chat at {rate} req/s on {fleet}, TTFT objective {objective:g} ms, {runs} runs, medians [min–max]")
print("| admission wait | requests | met the objective | TTFT p50 (ms) | TTFT p95 (ms) | A100s' share |")
print("|---|---|---|---|---|---|")
for name in ("without", "with"):
    rows = []
    for n, doc in bench_runs(out, name, runs):
        r = doc["runs"][0]
        hit = met(r, objective)
        cheap = share_of(doc, r, 25001, lambda i: i < len(gpus) and gpus[i].startswith("a100"))
        rows.append((hit, r["ttft_ms"]["p50"], r["ttft_ms"]["p95"], cheap, r["requests"]))
        print(f"  {name} run {n}: {r['requests']} requests, {r['failed']} failed{' ' + str(r['failures']) if r.get('failures') else ''}, met {100 * hit:.1f}%, "
              f"TTFT p50 {r['ttft_ms']['p50']:.0f} p95 {r['ttft_ms']['p95']:.0f} ms, A100s {100 * cheap:.0f}%", file=sys.stderr)
    if not rows:
        continue
    col = list(zip(*rows))
    m = spread
    print(f"| {name} | {m(col[4], '{:.0f}')} | {m([100 * x for x in col[0]], '{:.1f}')}% | "
          f"{m(col[1], '{:.0f}')} | {m(col[2], '{:.0f}')} | {m([100 * x for x in col[3]], '{:.0f}')}% |")
PY
