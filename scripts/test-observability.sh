#!/usr/bin/env bash
# `make test-observability`: envoy/observability/ checked by real components, in about a minute.
#
#  1. promtool: `check rules`, `test rules` (the unit tests), and every alert has a test case
#     where it fires (scripts/observability_check.py coverage).
#  2. Live: a simulated fleet of 4 vLLM servers (kvroute-sim serve, small KV caches so one can
#     be filled), Envoy with envoy/envoy.yaml (price tiers added: the last server premium, so
#     the tiers panels have series) and dist/kvroute.wasm, and a real Prometheus
#     running envoy/observability/prometheus.yml (targets moved to this run's ports, 1 s
#     scrape and rule intervals) with kvroute-rules.yaml. Traffic: a short shared-prefix
#     workload through Envoy, a few non-inference requests, and long requests sent straight
#     to server 0 so its KV cache goes past 0.9. Then every recording rule, every alert
#     expression (comparisons made `bool`) and every dashboard panel query is evaluated
#     through Prometheus's HTTP API: any empty result fails. The KV-pressure alert must fire
#     for server 0: the rules are loaded from a test copy whose `for:` durations are all cut
#     to FOR_S (5 s; the shipped rule says 5m), and nothing else in the copy differs.
#
# SCREENSHOTS=DIR: also saves Prometheus's graph page for the dashboard's main queries as
# PNGs there (headless Chromium, Debian's `chromium`), while the run's data is live.
# Knobs: OUT (default target/test-observability), SIM, WASM, ENVOY (scripts/lib.sh),
# PROMETHEUS / PROMTOOL (default: from PATH), ports SIM_BASE (21001; its admin port is
# SIM_BASE-1), ENVOY_PORT (21100), ADMIN_PORT (21901), PROM_PORT (21090).
# Every process started is stopped on exit, failure or Ctrl-C. Last line: `N passed, N failed`.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-target/test-observability}
SIM_BASE=${SIM_BASE:-21001}
ENVOY_PORT=${ENVOY_PORT:-21100}
ADMIN_PORT=${ADMIN_PORT:-21901}
PROM_PORT=${PROM_PORT:-21090}
PROMETHEUS=${PROMETHEUS:-prometheus}
PROMTOOL=${PROMTOOL:-promtool}
FOR_S=${FOR_S:-5}
OBS=envoy/observability

source scripts/lib.sh

for tool in "$PROMETHEUS" "$PROMTOOL"; do
  command -v "$tool" >/dev/null || { echo "$tool not found: run through 'make test-observability' (it installs Debian's prometheus)" >&2; exit 1; }
done
[ -x "$SIM" ] && [ -x "$ENVOY" ] && [ -f "$WASM" ] || { echo "run through 'make test-observability' (it builds first)" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT"

echo "==> promtool check rules / test rules"
"$PROMTOOL" check rules "$OBS/kvroute-rules.yaml"
"$PROMTOOL" test rules "$OBS/kvroute-rules.test.yaml"
python3 scripts/observability_check.py coverage "$OBS/kvroute-rules.yaml" "$OBS/kvroute-rules.test.yaml"

PROM_URL="http://127.0.0.1:$PROM_PORT"
require_free $(sim_ports) "$ENVOY_PORT" "$ADMIN_PORT" "$PROM_PORT"
snapshot_artifacts

echo "==> simulated fleet, Envoy + kvroute, Prometheus"
# 2048 KV blocks of 16 tokens per server (32k tokens): a few dozen requests fill one.
spawn "$OUT/sim.log" "$SIM" serve --servers "$SERVERS" --host 127.0.0.1 --base-port "$SIM_BASE" --num-gpu-blocks 2048
wait_for "the simulated servers" all_sim_ports_open
# envoy/envoy.yaml with price tiers (the last server premium), so the dashboard's tiers panels
# have series: the per-server TTFT scale exists only with tiers.
python3 - envoy/envoy.yaml "$OUT/envoy-tiers.yaml" <<'PY'
import sys
src, dst = sys.argv[1:3]
text = open(src).read()
marker = '"policy": "cost",'
assert text.count(marker) == 1, f"{src}: no single {marker}"
open(dst, "w").write(text.replace(marker, marker + ' "tiers": {"endpoints": {"127.0.0.1:8004": 1}},'))
PY
start_envoy obs "$OUT/envoy-tiers.yaml" 2

# The shipped rules with every `for:` cut to FOR_S seconds, so alerts can fire within the run.
sed -E "s/^( +)for: [0-9]+[smh]\$/\1for: ${FOR_S}s/" "$OBS/kvroute-rules.yaml" >"$OUT/kvroute-rules.yaml"
grep -q "for: ${FOR_S}s" "$OUT/kvroute-rules.yaml" || { echo "no for: was rewritten" >&2; exit 1; }
targets=$(for i in $(seq 0 $((SERVERS - 1))); do printf '"127.0.0.1:%s", ' $((SIM_BASE + i)); done)
sed -e 's/^\(  *\)scrape_interval: .*/\1scrape_interval: 1s/' \
  -e 's/^\(  *\)evaluation_interval: .*/\1evaluation_interval: 1s/' \
  -e "s/\"127\.0\.0\.1:9901\"/\"127.0.0.1:$ADMIN_PORT\"/" \
  -e "s/\[\"127\.0\.0\.1:8001\".*\]/[${targets%, }]/" \
  "$OBS/prometheus.yml" >"$OUT/prometheus.yml"
grep -q "127.0.0.1:$ADMIN_PORT" "$OUT/prometheus.yml" && grep -q "127.0.0.1:$SIM_BASE" "$OUT/prometheus.yml" ||
  { echo "could not point $OBS/prometheus.yml at this run's ports" >&2; exit 1; }
"$PROMTOOL" check config "$OUT/prometheus.yml" >/dev/null
spawn "$OUT/prometheus.log" "$PROMETHEUS" --config.file="$OUT/prometheus.yml" \
  --storage.tsdb.path="$OUT/prometheus-data" --web.listen-address="127.0.0.1:$PROM_PORT"
prom_ready() { curl -sf "$PROM_URL/-/ready" >/dev/null 2>&1; }
wait_for "Prometheus" prom_ready
require_loopback_only
targets_up() {
  [ "$(curl -sf "$PROM_URL/api/v1/query?query=count(up==1)" | python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)')" = $((SERVERS + 1)) ]
}
wait_for "Prometheus scraping Envoy and every server" targets_up

echo "==> server 0 past the KV threshold: long requests sent straight to it"
# 48 requests of 576 prompt and 1200 output tokens at once need 2.6x its 2048 blocks: it runs
# above 0.94 (and queues) for about 18 s. Many small requests rather than a few large ones:
# one finishing frees under 6% of the cache, so usage does not dip below 0.9 between
# scrapes (which would restart the alert's `for`). The alert fires FOR_S s after Prometheus
# first sees > 0.9.
spawn "$OUT/kv-fill.txt" "$SIM" bench --url "http://127.0.0.1:$SIM_BASE" --workload shared-prefix \
  --groups 48 --per-group 1 --system-tokens 512 --question-tokens 64 --output-tokens 1200 \
  --rate 200 --duration 1 --seed 7 --label kv-fill
fired=(0 1)
if python3 scripts/observability_check.py firing "$PROM_URL" KvrouteServerKVCachePressure \
  "instance=127.0.0.1:$SIM_BASE" --wait 30; then fired=(1 0); fi

echo "==> traffic through Envoy + kvroute: a shared-prefix workload and a few non-inference requests"
for _ in 1 2 3; do curl -sf "http://127.0.0.1:$ENVOY_PORT/v1/models" >/dev/null; done
run_waited "$OUT/bench.txt" "$OUT/bench.err" "$SIM" bench --url "http://127.0.0.1:$ENVOY_PORT" \
  --workload shared-prefix --groups 16 --per-group 10 --system-tokens 1024 --rate 8 \
  --output-tokens 32 --duration 20 --label through-envoy --json "$OUT/bench.json"
sed 's/^/    /' "$OUT/bench.txt"
sleep 3 # the last counters reach Prometheus and the rules run on them

echo "==> every rule, alert expression and dashboard query through Prometheus's HTTP API (results: $OUT/queries.md)"
python3 scripts/observability_check.py live "$PROM_URL" "$OBS/grafana-dashboard.json" \
  --prior-passed "${fired[0]}" --prior-failed "${fired[1]}" --report "$OUT/queries.md"

if [ -n "${SCREENSHOTS:-}" ]; then
  echo "==> screenshots of Prometheus's graph page into $SCREENSHOTS"
  mkdir -p "$SCREENSHOTS"
  shot() {
    local name=$1 expr=$2 url
    url="$PROM_URL/graph?$(python3 -c 'import sys, urllib.parse; print(urllib.parse.urlencode({"g0.expr": sys.argv[1], "g0.tab": "0", "g0.range_input": "1m", "g0.stacked": "0"}))' "$expr")"
    run_waited "$OUT/chromium-$name.log" "$OUT/chromium-$name.err" chromium --headless --no-sandbox --disable-gpu \
      --hide-scrollbars --window-size=1280,1050 --virtual-time-budget=8000 --user-data-dir="$OUT/chromium-profile" \
      --screenshot="$SCREENSHOTS/$name.png" "$url" || echo "screenshot $name failed (see $OUT/chromium-$name.err)"
  }
  shot decisions-by-outcome 'sum by (outcome) (rate(kvroute:requests_total[30s]))'
  shot cached-tokens-reported 'sum(rate(kvroute_tokens_reported_cached[30s])) / sum(rate(kvroute_tokens_prompt_reported[30s]))'
  shot server-share 'sum by (server) (rate(kvroute:endpoint_chosen_total[30s])) / ignoring (server) group_left sum(rate(kvroute:endpoint_chosen_total[30s]))'
  shot kv-cache-usage 'max by (instance) (vllm:kv_cache_usage_perc)'
  shot ttft-p95 'histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[30s])))'
  shot alerts 'ALERTS'
fi
