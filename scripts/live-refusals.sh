#!/usr/bin/env bash
# vLLM's 503 refusals, live (BENCHMARKS.md, "vLLM's 503 refusals, live"): real Envoy +
# dist/kvroute.wasm + `kvroute-sim serve` with vLLM's admission limit
# (`--max-num-queued-reqs LIMIT`), fresh fleet per run. Modes (MODES, all by default):
#   no-retry:        the shipped envoy.yaml (the client gets every refusal)
#   retry:           plus the opt-in 503 retry on kvroute's next server
#   retry-avoid:     plus overload.refused_ms 1000 (a refusing server goes last for 1 s)
#   retry-avoid-200: the same with 200 ms
#   hold-no-retry, hold-retry: no-retry and retry with overload.hold on (max_wait_ms HOLD_WAIT_MS or 1000,
#                    newest_first_after_ms HOLD_NEWEST_MS or 0, objective_wait_share HOLD_SHARE or 0,
#                    wait_limit_ms 100)
#   smg:             SGLang's model gateway (PyPI `smg`, cache_aware; `make setup-smg`) instead
#                    of Envoy, the single-process peer
# RATE req/s of the steady-state workload (400 prefixes) for DURATION s, or WORKLOAD (bench's
# workload arguments instead, e.g. a trace with --rate-scale); SLOW=k slows server
# 0 k times (a hot spot in a fleet with room); CONCURRENCY Envoy workers (2). Needs `make build setup-envoy`. OUT (default
# target/live-refusals) gets each run's JSON. Ports 24000-24004 and 24900-24903 must be free.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/live-refusals}
RUNS=${RUNS:-2}
RATE=${RATE:-150}
DURATION=${DURATION:-20}
LIMIT=${LIMIT:-16}
SIM_BASE=24001 ENVOY_PORT=24900 ADMIN_PORT=24901 SMG_PORT=24902 SMG_METRICS_PORT=24903
mkdir -p "$OUT"
source scripts/lib.sh

mode_config() { # mode, envoy config → the same with the mode's changes
  python3 - "$1" "$2" <<'PY'
import json, os, sys
mode, path = sys.argv[1:3]
s = open(path).read()
shipped = "retry_on: connect-failure,reset-before-request,refused-stream,reset\n"
assert shipped in s
overload = {}
if "hold" in mode:
    overload["hold"] = {"max_wait_ms": int(os.environ.get("HOLD_WAIT_MS", "1000")), "wait_limit_ms": 100,
                        "newest_first_after_ms": int(os.environ.get("HOLD_NEWEST_MS", "0")),
                        "objective_wait_share": float(os.environ.get("HOLD_SHARE", "0"))}
if "avoid" in mode:
    overload["refused_ms"] = 200 if mode.endswith("-200") else 1000
if overload:
    s = s.replace('"policy": "cost",', '"policy": "cost", "overload": %s,' % json.dumps(overload))
if "no-retry" not in mode:
    s = s.replace(shipped, shipped.rstrip("\n") + ",retriable-status-codes\n" + " " * 30 + "retriable_status_codes: [503]\n")
open(path, "w").write(s)
PY
}

for run in $(seq 1 "$RUNS"); do
  for mode in ${MODES:-no-retry retry retry-avoid retry-avoid-200 hold-no-retry hold-retry}; do
    require_free $(sim_ports) "$ENVOY_PORT" "$ADMIN_PORT" "$SMG_PORT" "$SMG_METRICS_PORT"
    spawn "$OUT/sim.log" "$SIM" serve --servers "$SERVERS" --max-num-queued-reqs "$LIMIT" --base-port "$SIM_BASE"
    wait_for "the simulated servers" all_sim_ports_open
    url="http://127.0.0.1:$ENVOY_PORT"
    if [ "$mode" = smg ]; then
      [ -x "$SMG" ] || { echo "$SMG missing: make setup-smg" >&2; exit 1; }
      start_smg live
      url="http://127.0.0.1:$SMG_PORT"
    else
      envoy_config envoy/envoy.yaml "$OUT/envoy.yaml" 0
      mode_config "$mode" "$OUT/envoy.yaml"
      spawn "$OUT/envoy.log" "$ENVOY" -c "$OUT/envoy.yaml" --concurrency "${CONCURRENCY:-2}" --use-dynamic-base-id -l warning
      wait_for "Envoy" envoy_ready "$ENVOY_PORT" "$ADMIN_PORT"
    fi
    sleep 1 # the first scrapes
    if [ -n "${SLOW:-}" ]; then # a hot spot: server 0 SLOW times slower than the others
      curl -s -X POST "127.0.0.1:$((SIM_BASE - 1))/servers/0/fault" -d "{\"slow\": $SLOW}" >/dev/null
    fi
    # bench exits non-zero when requests failed: the refusals are what is measured.
    # shellcheck disable=SC2086 # WORKLOAD is a list of arguments
    "$SIM" bench ${WORKLOAD:---workload shared-prefix --groups 400 --per-group 30 --rate $RATE --output-tokens 32} \
      --seed "$run" --url "$url" --duration "$DURATION" --json "$OUT/$mode-$run.json" \
      >/dev/null 2>&1 || true
    curl -s "127.0.0.1:$ADMIN_PORT/stats?filter=(upstream_rq_retry$|upstream_rq_503|kvroute.refused)" >"$OUT/$mode-$run-stats.txt" || true
    stop_all
  done
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/*.json")):
    r = json.load(open(f))["runs"][0]
    t = r["ttft_ms"]
    # Served within 1 s and 2 s, of the requests offered (the TTFT CDF's 1% steps).
    cdf, offered = r["ttft_cdf_ms"], r["completed"] + r["failed"]
    within = lambda ms: 100 * r["completed"] * sum(v <= ms for v in cdf[1:]) / (len(cdf) - 1) / max(offered, 1)
    stats = open(f[:-5] + "-stats.txt").read().split("\n")
    keep = ", ".join(l.strip() for l in stats if l.strip() and ("retry:" in l or "refused" in l or "vllm_pool.upstream_rq_503" in l))
    print(f"{os.path.basename(f)}: {r['completed']} done, {r['failed']} failed, TTFT p50 {t['p50']:.1f} p95 {t['p95']:.1f} p99 {t['p99']:.1f} ms, "
          f"within 1 s {within(1000):.1f}%, 2 s {within(2000):.1f}% of offered, "
          f"out tok/s {r['throughput']['output_tok_s']:.0f}, hit {100 * r['prefix_hit_rate']:.1f}% | {keep}")
PY
