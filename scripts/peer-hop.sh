#!/usr/bin/env bash
# How long one replica's POST to another takes to be answered (BENCHMARKS.md, "What the
# production topology costs, taken apart"): two Envoys with dist/kvroute.wasm exchanging
# placements (share.replicas, the replicas' cluster of envoy/fragments/), a fleet of
# `kvroute-sim serve` behind them. Times N POSTs of an empty batch (another replica's
# heartbeat) to replica 1's peer path on one kept-alive connection, answered 204 by its
# kvroute filter, against Envoy's admin /ready (no filter) on the same machine.
# Needs `make build setup-envoy`. OUT (default target/peer-hop), N (default 3000).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/peer-hop}
N=${N:-3000}
mkdir -p "$OUT"
source scripts/lib.sh
trap stop_all EXIT
start_fleet hop
start_envoy hop envoy/envoy.yaml 2 0 exchange
start_envoy hop envoy/envoy.yaml 2 1 exchange
sleep 2
python3 - "$((ENVOY_PORT + 1))" "$((ADMIN_PORT + 1))" "$N" <<'PY'
import http.client
import sys
import time

port, admin, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def timed(conn, method, path, body=None, headers=None):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        r.read()
        out.append((time.perf_counter() - t) * 1000)
        if r.status not in (200, 204):
            sys.exit(f"{method} {path}: {r.status}")
    # The first sixth warms the connection and the filter.
    out = sorted(out[n // 6:])
    return " ".join(f"p{q} {out[min(len(out) - 1, len(out) * q // 100)]:.3f}" for q in (10, 50, 90, 99))


secret = {"x-kvroute-peer-secret": "bench-live-replica-secret", "content-type": "application/x-protobuf"}
# Forward { replica: 1 }: a batch with no segments from a replica that is not this one.
print("POST to the peer path (kvroute answers), ms:", timed(http.client.HTTPConnection("127.0.0.1", port), "POST", "/kvroute/v1/peer-events", b"\x08\x01", secret))
print("GET admin /ready (no filter), ms:         ", timed(http.client.HTTPConnection("127.0.0.1", admin), "GET", "/ready"))
PY
