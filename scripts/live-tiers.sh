#!/usr/bin/env bash
# Price tiers, live (BENCHMARKS.md, "Price tiers with spillover"): real Envoy +
# dist/kvroute.wasm + `kvroute-sim serve`, rag at RATE req/s for DURATION s from a cold
# fleet, fresh fleet per run, three fleets:
#   premium:  3 × H100, kvroute (no tiers)
#   mixed:    4 × A100 + 2 × H100, kvroute (no tiers)
#   tiered:   4 × A100 (tier 0) + 2 × H100 (tier 1), `tiers` with each tier's sequence slots
# The TTFT objective is OBJECTIVE_MS (default 1000; the tier rule plans for the filter's
# default share of it). Prints, per run and as medians: the share of the requests offered
# whose TTFT met the objective (from the bench's 1%-step TTFT CDF; a failed request misses),
# TTFT p95, the H100s' share of the requests, and the fleet's price per hour at A100_PRICE /
# H100_PRICE (default 0.80 / 4.00, the 1 : 5 pair BENCHMARKS tests).
# Needs `make build setup-envoy`. Ports 24000-24006, 24900, 24901 must be free.
#   RUNS=3 DURATION=60 RATE=20 OUT=target/live-tiers bash scripts/live-tiers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/live-tiers}
RUNS=${RUNS:-3}
DURATION=${DURATION:-60}
RATE=${RATE:-20}
OBJECTIVE_MS=${OBJECTIVE_MS:-1000}
A100_PRICE=${A100_PRICE:-0.80}
H100_PRICE=${H100_PRICE:-4.00}
SIM=target/release/kvroute-sim
ENVOY=.venv/bin/envoy
mkdir -p "$OUT"
for f in "$SIM" "$ENVOY" dist/kvroute.wasm; do
  [ -e "$f" ] || { echo "missing $f: run make build setup-envoy" >&2; exit 2; }
done

config() { # servers, premium servers (the last ones; 0: no tiers) → $OUT/envoy.yaml
  python3 - "$1" "$2" "$OBJECTIVE_MS" "$OUT/envoy.yaml" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from live_fleet import envoy_config
n, premium, objective, out = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
plugin = ""
if premium:
    tiers = {"endpoints": {f"127.0.0.1:{24001 + i}": 1 for i in range(n - premium, n)},
             "ttft_objective_ms": objective, "max_num_seqs": [256, 1024]}
    plugin = f'"tiers": {json.dumps(tiers)},'
open(out, "w").write(envoy_config(n, 24001, 24900, 24901, plugin))
PY
}

run() { # name, premium servers (0: no tiers), fleet, run
  local name=$1 premium=$2 fleet=$3 n=$4
  local servers
  servers=$(python3 -c "import sys; print(sum(int(p.split('x')[0]) for p in sys.argv[1].split(',')))" "$fleet")
  config "$servers" "$premium"
  "$SIM" serve --fleet "$fleet" --base-port 24001 --admin-port 24000 >"$OUT/sim.log" 2>&1 &
  local sim=$!
  "$ENVOY" -c "$OUT/envoy.yaml" --concurrency 2 --use-dynamic-base-id -l warning >"$OUT/envoy.log" 2>&1 &
  local envoy=$!
  sleep 3
  "$SIM" bench --workload rag --rate "$RATE" --seed "$n" --url http://127.0.0.1:24900 \
    --duration "$DURATION" --json "$OUT/$name-$n.json" >/dev/null 2>&1 || echo "$name run $n: bench failed" >&2
  curl -s "127.0.0.1:24901/stats?filter=kvroute.tiers" >"$OUT/$name-$n-tiers.txt" || true
  kill "$envoy" "$sim" 2>/dev/null || true
  wait "$envoy" "$sim" 2>/dev/null || true
  sleep 1
}

for n in $(seq 1 "$RUNS"); do
  run premium 0 3xh100-80g:llama-3.1-8b "$n"
  run mixed 0 4xa100-80g:llama-3.1-8b,2xh100-80g:llama-3.1-8b "$n"
  run tiered 2 4xa100-80g:llama-3.1-8b,2xh100-80g:llama-3.1-8b "$n"
done

python3 - "$OUT" "$RUNS" "$OBJECTIVE_MS" "$A100_PRICE" "$H100_PRICE" <<'PY'
import sys
sys.path.insert(0, "scripts")
from live_fleet import bench_runs, met, share_of, spread
out, runs, objective, a100, h100 = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
fleets = {"premium": (0, 3), "mixed": (4, 2), "tiered": (4, 2)}
print(f"rag, TTFT objective {objective:g} ms, {runs} runs, medians [min–max]")
print("| fleet | routing | requests | met the objective | TTFT p95 (ms) | H100s' share | $/h |")
print("|---|---|---|---|---|---|---|")
for name, (cheap, premium) in fleets.items():
    rows = []
    for n, doc in bench_runs(out, name, runs):
        r = doc["runs"][0]
        hit = met(r, objective)
        prem = share_of(doc, r, 24001, lambda i: i >= cheap)  # the H100s follow the A100s
        rows.append((hit, r["ttft_ms"]["p95"], prem, r["requests"], r["failed"]))
        print(f"  {name} run {n}: {r['requests']} requests, {r['failed']} failed, met {100 * hit:.1f}%, "
              f"TTFT p95 {r['ttft_ms']['p95']:.0f} ms, max {r['ttft_cdf_ms'][-1]:.0f} ms, H100s {100 * prem:.0f}%", file=sys.stderr)
    if not rows:
        continue
    col = list(zip(*rows))
    m = spread
    label = {"premium": "3 H100", "mixed": "4 A100 + 2 H100", "tiered": "4 A100 + 2 H100"}[name]
    routing = "tiered" if name == "tiered" else "kvroute"
    print(f"| {label} | {routing} | {m(col[3], '{:.0f}')} | {m([100 * x for x in col[0]], '{:.1f}')}% | "
          f"{m(col[1], '{:.0f}')} | {m([100 * x for x in col[2]], '{:.0f}')}% | {cheap * a100 + premium * h100:.2f} |")
PY
