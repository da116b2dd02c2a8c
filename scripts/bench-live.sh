#!/usr/bin/env bash
# `make bench-live`: routers compared live on the same 4 simulated vLLM servers (Llama-3.1-8B
# on H100), a fresh fleet for every run:
#   - kvroute in Envoy at each --concurrency in CONCURRENCIES (default 1 8 16);
#   - Envoy round-robin at the same concurrencies;
#   - SGLang's model gateway (PyPI `smg`, cache_aware), the single-process peer;
#   - two Envoy processes with kvroute (REPLICA_CONCURRENCY workers each, default 8), each
#     scraping on its own, the client spreading requests at random (seeded) across both.
# Two workloads: the steady-state one (400 shared 2048-token prompts, 1.75× one server's KV
# cache, at RATE req/s for DURATION s; the first COLD_S s reported as the cold start, the rest
# as the steady state) and the 1024-request cold-start burst (64 prompts x 16 at 140 req/s).
# Each case runs RUNS times (default 3); run k uses workload seed k-1 for every case, and the
# cases alternate inside a run so drifts in machine load spread over all of them. It prints
# medians and ranges (hit rate, TTFT p50/p95/p99) and issue 11's goals as measured.
#
# Knobs (environment): RUNS, CONCURRENCIES, REPLICA_CONCURRENCY, RATE (100), DURATION (120),
# COLD_S (15), WORKLOADS ("steady burst"), PEER (1: include smg), REPLICAS (1: include the
# two-Envoy case), REPLICAS_OPTIONS (more of that case's share.replicas, e.g.
# '"from_workers": false'), OUT (target/bench-live); ports as in scripts/lib.sh. Every process it
# starts listens on 127.0.0.1 only and is stopped on exit, failure and Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-target/bench-live}
RUNS=${RUNS:-3}
CONCURRENCIES=${CONCURRENCIES:-1 8 16}
REPLICA_CONCURRENCY=${REPLICA_CONCURRENCY:-8}
RATE=${RATE:-100}
DURATION=${DURATION:-120}
COLD_S=${COLD_S:-15}
WORKLOADS=${WORKLOADS:-steady burst}
PEER=${PEER:-1}
REPLICAS=${REPLICAS:-1}

source scripts/lib.sh

[ -x "$SIM" ] && [ -x "$ENVOY" ] && [ -f "$WASM" ] || { echo "run through 'make bench-live' (it builds first)" >&2; exit 1; }
[ "$PEER" != 1 ] || [ -x "$SMG" ] || { echo "$SMG missing: run through 'make bench-live' (it installs smg)" >&2; exit 1; }
for c in $CONCURRENCIES $REPLICA_CONCURRENCY $RUNS; do
  [[ "$c" =~ ^[1-9][0-9]*$ ]] || { echo "RUNS, CONCURRENCIES and REPLICA_CONCURRENCY must be positive integers" >&2; exit 1; }
done
snapshot_artifacts
require_free $(sim_ports) "$ENVOY_PORT" "$((ENVOY_PORT + 1))" "$ADMIN_PORT" "$((ADMIN_PORT + 1))" "$SMG_PORT" "$SMG_METRICS_PORT"
mkdir -p "$OUT/runs"
INDEX="$OUT/index.tsv"
: >"$INDEX"
failures=()

# Cases: "id|router|workers|kind|concurrency" (kind: envoy, rr, smg, replicas).
cases=()
for c in $CONCURRENCIES; do cases+=("kvroute-c$c|kvroute|$c|envoy|$c"); done
for c in $CONCURRENCIES; do cases+=("round-robin-c$c|round-robin|$c|rr|$c"); done
[ "$PEER" = 1 ] && cases+=("smg|smg cache_aware|-|smg|0")
[ "$REPLICAS" = 1 ] && cases+=("kvroute-2x$REPLICA_CONCURRENCY|kvroute, 2 Envoy processes|2 x $REPLICA_CONCURRENCY|replicas|$REPLICA_CONCURRENCY")

workload_args() {
  local seed=$1
  case $2 in
    steady) echo "--workload shared-prefix --groups 400 --per-group 30 --rate $RATE --output-tokens 32 --duration $DURATION --seed $seed" ;;
    burst) echo "--workload shared-prefix --groups 64 --per-group 16 --rate 140 --output-tokens 32 --duration 60 --seed $seed" ;;
    *) echo "unknown workload $2 (steady, burst)" >&2; return 1 ;;
  esac
}

workload_name() {
  case $1 in
    steady) echo "steady-state workload (400 prompts, $RATE req/s, $DURATION s)" ;;
    burst) echo "cold-start burst (1024 requests)" ;;
  esac
}

# One line per run: what it measured.
brief() {
  python3 - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["runs"]:
        t = r["ttft_ms"]
        print("    %-28s hit %5.1f%%  TTFT p50 %6.0f  p95 %6.0f  p99 %6.0f ms  failed %d/%d"
              % (r["policy"], r["prefix_hit_rate"] * 100, t["p50"], t["p95"], t["p99"], r["failed"], r["requests"]))
PY
}

# What each of the two replicas did with the other (its exchange's stats, kept beside the run).
replica_stats() {
  local tag=$1 k file
  for k in 0 1; do
    file="$OUT/runs/$tag-replica-$k.stats"
    curl -sf "http://127.0.0.1:$((ADMIN_PORT + k))/stats?filter=kvroute\.replicas\." >"$file" || continue
    printf '    replica %s: %s\n' "$k" "$(sed -e 's/^wasmcustom\.kvroute\.replicas\.//' "$file" | tr '\n' ' ')"
  done
}

# One run of one case on one workload, on a fresh fleet. Returns non-zero on any failure.
run_case() {
  local spec=$1 wl=$2 run=$3
  local id router workers kind conc
  IFS='|' read -r id router workers kind conc <<<"$spec"
  local tag="$wl-$id-r$run"
  local url="http://127.0.0.1:$ENVOY_PORT"
  start_fleet "$tag" || return 1
  case $kind in
    envoy) start_envoy "$tag" envoy/envoy.yaml "$conc" 0 || return 1 ;;
    rr) start_envoy "$tag" envoy/envoy-round-robin.yaml "$conc" 0 || return 1 ;;
    replicas)
      start_envoy "$tag" envoy/envoy.yaml "$conc" 0 exchange || return 1
      start_envoy "$tag" envoy/envoy.yaml "$conc" 1 exchange || return 1
      url="http://127.0.0.1:$ENVOY_PORT,http://127.0.0.1:$((ENVOY_PORT + 1))"
      ;;
    smg)
      start_smg "$tag" || return 1
      url="http://127.0.0.1:$SMG_PORT"
      ;;
  esac
  require_loopback_only || return 1
  sleep 1 # a few metrics scrapes reach every router
  local args
  args=$(workload_args "$((run - 1))" "$wl") || return 1
  local json="$OUT/runs/$tag.json" phases="$OUT/runs/$tag.phases.json" rc=0
  local phases_env=()
  [ "$wl" = steady ] && phases_env=("KVROUTE_BENCH_COLD_S=$COLD_S" "KVROUTE_BENCH_PHASES_JSON=$phases")
  # shellcheck disable=SC2086 # word splitting of the workload arguments is intended
  run_waited "$OUT/runs/$tag.txt" "$OUT/runs/$tag.err" env "${phases_env[@]+"${phases_env[@]}"}" \
    "$SIM" bench --url "$url" $args --label "$router" --json "$json" || rc=$?
  [ "$kind" = replicas ] && replica_stats "$tag"
  stop_all
  local name
  name=$(workload_name "$wl")
  if [ "$wl" = steady ] && [ -f "$phases" ]; then
    printf '%s\tcold\t%s\t%s\t%s\t%s\t0\n' "$name" "$router" "$workers" "$run" "$phases" >>"$INDEX"
    printf '%s\tsteady\t%s\t%s\t%s\t%s\t1\n' "$name" "$router" "$workers" "$run" "$phases" >>"$INDEX"
    brief "$phases"
  elif [ "$wl" = burst ] && [ -f "$json" ]; then
    printf '%s\tcold\t%s\t%s\t%s\t%s\t0\n' "$name" "$router" "$workers" "$run" "$json" >>"$INDEX"
    brief "$json"
  fi
  [ "$rc" = 0 ] || { echo "    bench failed (exit $rc): $(tail -n 1 "$OUT/runs/$tag.err")" >&2; return 1; }
}

total=$((RUNS * ${#cases[@]} * $(wc -w <<<"$WORKLOADS")))
n=0
started=$SECONDS
for run in $(seq 1 "$RUNS"); do
  for wl in $WORKLOADS; do
    for spec in "${cases[@]}"; do
      n=$((n + 1))
      IFS='|' read -r _ router workers _ _ <<<"$spec"
      echo "==> [$n/$total, $((SECONDS - started)) s] run $run, $wl, $router, Envoy workers: $workers"
      if ! run_case "$spec" "$wl" "$run"; then
        stop_all
        failures+=("run $run, $wl, $router ($workers)")
      fi
    done
  done
done

{
  echo "Live routers on 4 simulated Llama-3.1-8B/H100 servers, fresh fleet per run, $(nproc) cores;"
  echo "medians over runs with [min–max]; cold = requests scheduled in the first $COLD_S s of the"
  echo "steady-state workload, or the whole burst; steady = the rest ($(date -u +%Y-%m-%dT%H:%MZ), build $BUILD; $OUT/bin/SHA256SUMS)."
  echo
  python3 scripts/live_summary.py "$INDEX" --checks
} | tee "$OUT/summary.md"
echo "summary: $OUT/summary.md; every run's JSON and log: $OUT/runs/"
if [ ${#failures[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failures[@]}" >&2
  exit 1
fi
