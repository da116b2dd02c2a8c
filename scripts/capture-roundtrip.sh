#!/usr/bin/env bash
# Capture → replay, live (BENCHMARKS.md, "Capture and replay"): real Envoy + dist/kvroute.wasm
# with capture on and the shipped access log (envoy/capture/access-log.yaml) in front of
# `kvroute-sim serve` (4 × H100, 8B); `kvroute-sim bench` drives the steady-state workload
# (400 × 2048-token shared prefixes, working set ≈ 1.75 × one server's cache) for DURATION
# seconds; the capture is replayed on the same fleet and topology (1 gateway, 2 workers
# sharing one view, 2 ms tick) with kvroute and with round-robin. Fresh fleet per run.
# Needs `make build setup-envoy`. OUT (default target/capture-roundtrip) keeps every run's
# capture and JSON. Ports 24000-24004, 24900, 24901 must be free.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/capture-roundtrip}
RUNS=${RUNS:-3}
DURATION=${DURATION:-60}
SIM=target/release/kvroute-sim
ENVOY=.venv/bin/envoy
WORKLOAD=(--workload shared-prefix --groups 400 --per-group 30 --rate 100 --output-tokens 32)
mkdir -p "$OUT"

python3 - "$OUT" <<'PY'
import os, sys
out = os.path.abspath(sys.argv[1])
s = open("envoy/envoy.yaml").read()
for i in range(4):
    s = s.replace(f"port_value: 800{i + 1} ", f"port_value: 2400{i + 1} ")
s = s.replace("port_value: 9901", "port_value: 24901").replace("port_value: 10000", "port_value: 24900")
log = "".join(" " * 16 + l + "\n" for l in open("envoy/capture/access-log.yaml").read().splitlines() if not l.startswith("#"))
log = log.replace("/var/log/kvroute/capture.jsonl", f"{out}/capture.jsonl")
anchor = " " * 16 + "stat_prefix: inference\n"
discovery = '"discovery": {"admin_cluster": "kvroute_admin", "cluster": "vllm_pool"}'
assert anchor in s and discovery in s
s = s.replace(anchor, anchor + log, 1)
s = s.replace(discovery, discovery + ', "capture": {"sample": 1.0, "salt": "capture-roundtrip-salt-0123"}', 1)
open(f"{out}/envoy.yaml", "w").write(s)
PY

for run in $(seq 1 "$RUNS"); do
  rm -f "$OUT/capture.jsonl"
  "$SIM" serve --servers 4 --base-port 24001 --admin-port 24000 >"$OUT/sim.log" 2>&1 &
  SIM_PID=$!
  "$ENVOY" -c "$OUT/envoy.yaml" --concurrency 2 --use-dynamic-base-id -l warning >"$OUT/envoy.log" 2>&1 &
  ENVOY_PID=$!
  sleep 3
  "$SIM" bench "${WORKLOAD[@]}" --seed "$run" --url http://127.0.0.1:24900 --duration "$DURATION" \
    --json "$OUT/live-$run.json" >/dev/null 2>&1
  sleep 2 # the access log flushes every second
  kill "$ENVOY_PID" "$SIM_PID" 2>/dev/null || true
  wait "$ENVOY_PID" "$SIM_PID" 2>/dev/null || true
  mv "$OUT/capture.jsonl" "$OUT/capture-$run.jsonl"
  "$SIM" replay --trace "$OUT/capture-$run.jsonl" --format capture --servers 4 --workers 2 --tick-ms 2 \
    --policy kvroute,round-robin --json "$OUT/replay-$run.json" 2>"$OUT/replay-$run.log" >/dev/null
  sleep 1
done

python3 - "$OUT" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
rows = {"live (Envoy + kvroute)": [], "replay of its capture, kvroute": [], "replay of its capture, round-robin": []}
for k in range(1, runs + 1):
    live = json.load(open(f"{out}/live-{k}.json"))["runs"][0]
    rep = {r["policy"]: r for r in json.load(open(f"{out}/replay-{k}.json"))["runs"]}
    for name, r in zip(rows, [live, rep["kvroute"], rep["round-robin"]]):
        rows[name].append((100 * r["prefix_hit_rate"], r["ttft_ms"]["p50"], r["ttft_ms"]["p95"], r["completed"]))
def cell(v, fmt):
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}–{fmt.format(max(v))}]"
print(f"{runs} runs, medians [min–max]\n")
print("| | requests | hit rate | TTFT p50 | TTFT p95 |\n|---|---|---|---|---|")
for name, v in rows.items():
    hit, p50, p95, n = zip(*v)
    print(f"| {name} | {int(statistics.median(n))} | {cell(hit, '{:.1f}')}% | {cell(p50, '{:.1f}')} ms | {cell(p95, '{:.0f}')} ms |")
live, rep = rows["live (Envoy + kvroute)"], rows["replay of its capture, kvroute"]
print("\nper run, replay − live: " + "; ".join(
    f"hit {r[0] - l[0]:+.1f} points, TTFT p50 ×{r[1] / l[1]:.2f}" for l, r in zip(live, rep)))
PY
