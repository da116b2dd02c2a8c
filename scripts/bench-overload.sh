#!/usr/bin/env bash
# Overload with holding (`overload.hold`), replay: kvroute with holding on beside the peers
# (and kvroute without it) at 80/110/130% of capacity, tenants and priority bands assigned,
# 3 replicas per cell. Prints each cell's table and per-class table; JSON in $OUT.
#   OUT=target/overload bash scripts/bench-overload.sh
# With WORKERS=1 it then runs kvroute with holding on 2 gateways x 8 workers at 130%, with
# one hold queue per process (the filter) and with one per worker (--hold-per-worker).
# That topology models today's filter: placements that are news leave for the other replica
# from the workers (share.replicas.from_workers, 20 POSTs a second); the rest is flushed every
# 2 ms and reaches the other replica with the scraping service's batches (every 5 ms).
# FORWARDING=service gives the model before 2026-11-29 (every event through the scraping
# service's 5 ms batches), which the figures in BENCHMARKS.md up to then used.
# ONE_ROUTER=0 skips the one-router cells; OBJECTIVES=0 the cells with an objective per band.
set -euo pipefail
cd "$(dirname "$0")/.."
SIM=${SIM:-target/release/kvroute-sim}
OUT=${OUT:-target/overload}
REPLICAS=${REPLICAS:-3}
mkdir -p "$OUT"
# Holding as filter/core/README.md tells an operator to set it: max_wait_ms about half the
# cell's TTFT objective (1000 for the 2 s cells, 5000 for Mooncake's 10 s), wait_limit_ms at its
# default. hold_config SLO_MS writes the cell's configuration and prints its path.
hold_config() {
  local path="$OUT/hold-$1.json"
  echo "{\"overload\": {\"hold\": {\"max_wait_ms\": $(($1 / 2)), \"wait_limit_ms\": 1000}}}" > "$path"
  echo "$path"
}
CLASSES=(--tenants 0.7,0.1,0.1,0.1 --priorities 1:0.2,0:0.7,-1:0.1 --replicas "$REPLICAS")
PEERS=round-robin,least-request,gie-weighted,sglang-cache-aware,dynamo-kv,kvroute

cell() { # name, slo_ms, workload args...
  local name=$1 slo=$2; shift 2
  echo "### $name (TTFT objective $slo ms)"
  "$SIM" replay "$@" "${CLASSES[@]}" --ttft-slo-ms "$slo" --policy "$PEERS" --json "$OUT/$name-peers.json" 2>/dev/null
  local hold
  hold=$(hold_config "$slo")
  echo "kvroute with overload.hold: $(cat "$hold")"
  "$SIM" replay "$@" "${CLASSES[@]}" --ttft-slo-ms "$slo" --policy kvroute --router-config "$hold" \
    --json "$OUT/$name-hold.json" 2>/dev/null
}

# The issue's steady-state workload: 400 prefixes, larger than one server's cache; 4 servers,
# capacity about 160 req/s (kvroute, measured with --rate sweeps on the engine before
# 2026-11-28).
SP=(--workload shared-prefix --groups 400 --per-group 30 --servers 4)
if [ "${ONE_ROUTER:-1}" = 1 ]; then
for load in 80:130 110:175 130:210; do
  cell "shared-prefix-400-${load%%:*}" 2000 "${SP[@]}" --rate "${load##*:}"
done
# rag and Mooncake on 8 servers: capacity 91.57 and 10.18 req/s (BENCHMARKS, matrix, with
# blocks cached when scheduled; 63.3 and 10.19 on the engine before 2026-11-28).
for load in 110:100.7 130:119.0; do
  cell "rag-${load%%:*}" 2000 --workload rag --rate "${load##*:}" --servers 8
done
for load in 110:2.87 130:3.39; do
  cell "mooncake-${load%%:*}" 10000 --trace simulator/traces/mooncake_synthetic.jsonl --format mooncake \
    --rate-scale "${load##*:}" --servers 8
done
# Azure code with the prefix overlay on 8 servers: capacity 260.68 req/s (matrix), 2.569 req/s
# in the trace as given.
for load in 110:111.6 130:131.9; do
  cell "azure-${load%%:*}" 2000 --trace simulator/traces/azure_code_2023.csv --format azure --prefix-overlay 32 \
    --rate-scale "${load##*:}" --servers 8
done
fi

# Each band its own objective (--objectives: the band's requests send it in kvroute's
# objective header and count as goodput within it): the peers, kvroute with one bound (half
# the default objective, as above) and kvroute with each request's own (objective_wait_share 0.5,
# max_wait_ms half the longest objective). OBJECTIVES=0 skips these cells.
objectives_cell() { # name, default slo_ms, objectives, longest objective ms, workload args...
  local name=$1 slo=$2 objectives=$3 longest=$4; shift 4
  local own="$OUT/hold-own-$name.json"
  echo "{\"overload\": {\"hold\": {\"max_wait_ms\": $((longest / 2)), \"wait_limit_ms\": 1000, \"objective_wait_share\": 0.5}}}" > "$own"
  echo "### $name, objectives by band $objectives (default $slo ms)"
  "$SIM" replay "$@" "${CLASSES[@]}" --objectives "$objectives" --ttft-slo-ms "$slo" --policy "$PEERS" \
    --json "$OUT/$name-objectives-peers.json" 2>/dev/null
  local one
  one=$(hold_config "$slo")
  for config in "$one" "$own"; do
    echo "kvroute with overload.hold: $(cat "$config")"
    "$SIM" replay "$@" "${CLASSES[@]}" --objectives "$objectives" --ttft-slo-ms "$slo" --policy kvroute \
      --router-config "$config" --json "$OUT/$name-objectives-$(basename "$config" .json).json" 2>/dev/null
  done
}
if [ "${OBJECTIVES:-1}" = 1 ]; then
  objectives_cell shared-prefix-400-130 2000 1:1000,0:2000,-1:10000 10000 "${SP[@]}" --rate 210
  objectives_cell mooncake-130 10000 1:5000,0:10000,-1:30000 30000 --trace simulator/traces/mooncake_synthetic.jsonl \
    --format mooncake --rate-scale 3.39 --servers 8
  objectives_cell azure-130 2000 1:1000,0:2000,-1:10000 10000 --trace simulator/traces/azure_code_2023.csv --format azure \
    --prefix-overlay 32 --rate-scale 131.9 --servers 8
fi

if [ "${WORKERS:-0}" = 1 ]; then
  TOPO=(--gateways 2 --workers 8 --share-gateways --gateway-interval-ms 5 --gateway-delay-ms 0.25 --tick-ms 2)
  case "${FORWARDING:-workers}" in
    workers) TOPO+=(--news-flush-ms 2 --hits-when-quiet --read-once-per-ms --direct-placements) ;;
    service) ;;
    *) echo "FORWARDING must be workers or service" >&2; exit 2 ;;
  esac
  for queues in process worker; do
    per=(); [ $queues = worker ] && per=(--hold-per-worker)
    hold28() { # name, slo_ms, workload args...
      local name=$1 slo=$2; shift 2
      echo "### $name on 2 x 8 workers, one hold queue per $queues"
      "$SIM" replay "$@" "${CLASSES[@]}" "${TOPO[@]}" "${per[@]}" --ttft-slo-ms "$slo" --policy kvroute \
        --router-config "$(hold_config "$slo")" --json "$OUT/$name-2x8-$queues.json" 2>/dev/null
    }
    hold28 shared-prefix-400-130 2000 "${SP[@]}" --rate 210
    hold28 mooncake-130 10000 --trace simulator/traces/mooncake_synthetic.jsonl --format mooncake --rate-scale 3.39 --servers 8
    hold28 azure-130 2000 --trace simulator/traces/azure_code_2023.csv --format azure --prefix-overlay 32 \
      --rate-scale 131.9 --servers 8
  done
fi
