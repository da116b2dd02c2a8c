#!/usr/bin/env bash
# A pool that changes under traffic, replay: on 8 H100s at about 80% load, one server leaves
# mid-run (a scale-in or an evicted pod: its cache is lost) or joins mid-run (a scale-out:
# 7 servers before, 8 after), for kvroute beside the peers and the oracle, 3 replicas. Per
# change: the server's share of arrivals after it and TTFT p95 / captured reuse of the
# arrivals 10 s before and after; then the whole run's table. JSON and each run's stderr in $OUT.
#   OUT=target/pool bash scripts/bench-pool.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SIM=${SIM:-target/release/kvroute-sim}
OUT=${OUT:-target/pool}
REPLICAS=${REPLICAS:-3}
mkdir -p "$OUT"
POLICIES=least-request,gie-weighted,sglang-cache-aware,dynamo-kv,kvroute,oracle

cell() { # name, change args, workload args...
  local name=$1 change=$2; shift 2
  echo "### $name ${change:+($change)}"
  # shellcheck disable=SC2086 # the change is two words
  "$SIM" replay "$@" $change --policy "$POLICIES" --replicas "$REPLICAS" --json "$OUT/$name.json" 2>"$OUT/$name.log"
}

# Multi-turn: 2,000 conversations of 6 turns (12,000 requests over 87 s, 138 req/s); their
# histories (about 4M tokens) exceed one server's cache (468k) several times over.
MT=(--workload multi-turn --groups 2000 --rate 200 --rate-scale 1.5 --servers 8)
cell multi-turn-leave "--leave 0@40" "${MT[@]}"
cell multi-turn-join "--join 7@40" "${MT[@]}"
# Mooncake at 80% of the matrix's 8-server capacity (10.19 req/s): 490 s of arrivals.
MC=(--trace simulator/traces/mooncake_synthetic.jsonl --format mooncake --rate-scale 2.087 --servers 8)
cell mooncake-leave "--leave 0@240" "${MC[@]}"
cell mooncake-join "--join 7@240" "${MC[@]}"
# Azure code with the 32-group prefix overlay at 80% (260.68 req/s capacity): 42 s.
AZ=(--trace simulator/traces/azure_code_2023.csv --format azure --prefix-overlay 32 --rate-scale 81.2 --servers 8)
cell azure-leave "--leave 0@20" "${AZ[@]}"
cell azure-join "--join 7@20" "${AZ[@]}"
# A slower GPU joins a warm fleet: 4 H100s, and an A100 (server 4) that joins mid-run, at
# about half of the H100s' capacity; kvroute also with the configured constant speed
# (`cost.learn_speeds` false) for comparison.
echo '{"cost": {"learn_speeds": false}}' > "$OUT/constant.json"
MIX=(--fleet 4xh100-80g:llama-3.1-8b,1xa100-80g:llama-3.1-8b)
MMT=(--workload multi-turn --groups 2000 --rate 200 --rate-scale 0.5 "${MIX[@]}" --join 4@90)
MAZ=(--trace simulator/traces/azure_code_2023.csv --format azure --prefix-overlay 32 --rate-scale 25 "${MIX[@]}" --join 4@60)
cell mixed-multi-turn-join "" "${MMT[@]}"
echo "kvroute with the constant speed:"
"$SIM" replay "${MMT[@]}" --policy kvroute --router-config "$OUT/constant.json" --replicas "$REPLICAS" \
  2>"$OUT/mixed-multi-turn-constant.log"
cell mixed-azure-join "" "${MAZ[@]}"
echo "kvroute with the constant speed:"
"$SIM" replay "${MAZ[@]}" --policy kvroute --router-config "$OUT/constant.json" --replicas "$REPLICAS" \
  2>"$OUT/mixed-azure-constant.log"
