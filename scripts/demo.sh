#!/usr/bin/env bash
# `make run`: four simulated vLLM servers (Llama-3.1-8B on H100) behind real Envoy, first
# with kvroute (envoy/envoy.yaml), then with plain round-robin (envoy/envoy-round-robin.yaml),
# the same shared-prefix workloads through each on a fresh fleet, then one table and an SVG
# report. Every process it starts is stopped on exit, on failure and on Ctrl-C.
#
# The workload is one where routing matters: 400 shared 2048-token system prompts (819k
# tokens of prefix: 1.75× one server's KV cache, 0.44× the pool's) at RATE req/s for
# DURATION s. A router that keeps each prefix on one server serves it from cache; one that
# spreads prefixes over every server cannot hold them all. The table reports the cold start
# (requests scheduled in the first COLD_S s, while the caches fill) apart from the steady
# state (the rest). Before it, the 1024-request burst (64 prompts, 140 req/s, ≈ 7 s) that
# `make run` used to show: a cold-start figure only, since its prefixes fit in every cache.
#
# Knobs (environment): CONCURRENCY (Envoy workers, default 2), RATE (default 100),
# DURATION (s, default 120), COLD_S (default 15), BURST (1: also the burst; default 1),
# API (chat, or messages: Anthropic's /v1/messages as Claude Code sends it, an attribution
# block with a hash of its own on every request; default chat), OUT (default target/demo);
# ports as in scripts/lib.sh (default 8000-8004, 9901, 10000); WASM (the filter, default
# dist/kvroute.wasm).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-target/demo}
CONCURRENCY=${CONCURRENCY:-2}
API=${API:-chat}
RATE=${RATE:-100}
DURATION=${DURATION:-120}
COLD_S=${COLD_S:-15}
BURST=${BURST:-1}
STEADY=(--workload shared-prefix --groups 400 --per-group 30 --rate "$RATE" --output-tokens 32 --duration "$DURATION")
BURST_WL=(--workload shared-prefix --groups 64 --per-group 16 --rate 140 --output-tokens 32 --duration 60)

source scripts/lib.sh

[ -x "$SIM" ] && [ -x "$ENVOY" ] && [ -f "$WASM" ] || { echo "run through 'make run' (it builds first)" >&2; exit 1; }
[[ "$CONCURRENCY" =~ ^[1-9][0-9]*$ ]] || { echo "CONCURRENCY must be a positive integer (Envoy's --concurrency)" >&2; exit 1; }
require_free $(sim_ports) "$ENVOY_PORT" "$ADMIN_PORT"
mkdir -p "$OUT"
rm -f "$OUT/index.tsv"
snapshot_artifacts

# One run on a fresh fleet and Envoy: label, config, then the bench arguments.
run_once() {
  local label=$1 config=$2 tag=$3
  shift 3
  start_fleet "$tag"
  start_envoy "$tag" "$config" "$CONCURRENCY"
  require_loopback_only
  sleep 1 # a few metrics scrapes reach kvroute's workers
  run_waited "$OUT/bench-$tag.txt" /dev/stderr env ${PHASES:+"KVROUTE_BENCH_COLD_S=$COLD_S" "KVROUTE_BENCH_PHASES_JSON=$PHASES"} \
    "$SIM" bench --url "http://127.0.0.1:$ENVOY_PORT" --api "$API" "$@" --label "$label" --json "$OUT/$tag.json"
  grep '^  ' "$OUT/bench-$tag.txt" | sed 's/^/    /' || true
  stop_all
}

side() {
  local label=$1 config=$2
  if [ "$BURST" = 1 ]; then
    echo "==> [$label] burst: 1024 requests (64 prompts x 16) at 140 req/s, fresh fleet, Envoy --concurrency $CONCURRENCY"
    PHASES='' run_once "$label" "$config" "$label-burst" "${BURST_WL[@]}"
    printf 'burst (1024 requests)\tcold\t%s\t%s\t1\t%s\t0\n' "$label" "$CONCURRENCY" "$OUT/$label-burst.json" >>"$OUT/index.tsv"
  fi
  echo "==> [$label] steady: 400 prompts x 30 at $RATE req/s for $DURATION s (first $COLD_S s reported as the cold start), fresh fleet, Envoy --concurrency $CONCURRENCY"
  PHASES="$OUT/$label-phases.json" run_once "$label" "$config" "$label-steady" "${STEADY[@]}"
  for i in 0 1; do
    local phase=cold
    [ "$i" = 1 ] && phase=steady
    printf '400 prompts, %s s\t%s\t%s\t%s\t1\t%s\t%s\n' "$DURATION" "$phase" "$label" "$CONCURRENCY" "$OUT/$label-phases.json" "$i" >>"$OUT/index.tsv"
  done
}

side kvroute envoy/envoy.yaml
side round-robin envoy/envoy-round-robin.yaml

# The steady state alone, for `compare` (its ratio line and the SVG).
for label in kvroute round-robin; do
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d["runs"]=d["runs"][1:]; json.dump(d,open(sys.argv[2],"w"))' \
    "$OUT/$label-phases.json" "$OUT/$label-steady-only.json"
done

echo
echo "==> kvroute vs round-robin, same Envoy (--concurrency $CONCURRENCY), same simulated fleet, fresh each run (TTFT in ms; build $BUILD)"
python3 scripts/live_summary.py "$OUT/index.tsv" | tee "$OUT/summary.md"
echo
echo "==> steady state (requests scheduled after the first $COLD_S s)"
"$SIM" compare "$OUT/kvroute-steady-only.json" "$OUT/round-robin-steady-only.json" --plot "$OUT/report.svg" \
  --title "shared-prefix, 400 prompts at $RATE req/s, steady state, 4 x Llama-3.1-8B on H100 (simulated), Envoy --concurrency $CONCURRENCY: kvroute vs round-robin"
